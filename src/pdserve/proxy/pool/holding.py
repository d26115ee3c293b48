"""The elastic pool's hold: requests wait at the proxy while every decode-side instance runs the most its
TPOT objective allows (``ElasticRouter.room``), instead of joining batches that would then miss it.

Past that point another request in a batch slows every stream there: in a burst of 120 req/s of 1,000-token
answers, eight instances that take all of it run batches whose tokens come slower than the objective, and
few requests meet it. Held back, the requests admitted keep their pace and the rest start as streams end.

- who goes first when room opens: the waiting request whose deadline comes first among those that can
  still meet their TTFT objective; those past it go after, oldest first. A request that has missed its
  first token's objective should not take the place of one that still can. The deadline leaves a fifth
  of the objective for computing the prompt: with none, the head of the line under sustained overload is
  always a request about to be late, and each placed one misses by its prefill (phases 3 and 4 of
  benchmarks/elastic.py, eight colocated at 94 requests each: 1,020 of 3,118 late that way, 512 with the
  fifth left).
- a late request takes room only beyond what the requests arriving within the next deadline's span
  may need (``ElasticRouter.expected_arrivals``, times ``_FRESH_RESERVE``): placed in every gap, the late
  ones of an overloaded phase fill the batches just before fresh requests come, which then wait and
  are late in turn, and the line an overload leaves carries into the phases after it (seed 5 of the
  mixed traces, TTFT 300 ms / TPOT 10 ms: ~400 waiting all through its long-answer phase, 23 req/s
  where four colocated instances without a hold serve 50).
- no request waits past ``max_s``: then it is placed whatever the room (nothing waits without bound).
- a request whose client leaves while it waits, or between being woken and being placed, gives its turn
  to the next.

The clock and the sleep are given: the proxy passes its monotonic time, the simulated cluster its virtual
clock. No HTTP here.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.proxy.pool.elastic import ElasticRouter, Measured, Placement
from pdserve.proxy.pool.routing import C

# A request placed after this share of its TTFT objective has passed counts as late: the rest is for
# computing its prompt.
_LATE_SHARE = 0.8
# The share of the requests expected within that span whose room a late request leaves to them. Half:
# with all of them, the mixed traces' agent bursts lost most of what they served without a reserve (seed
# 7 at TTFT 1 s: 22 req/s against 39), since a burst's rate kept room for arrivals its end never brought
# (benchmarks/elastic_mixed.py; the expected arrivals now also end with the traffic).
_FRESH_RESERVE = 0.5


@dataclass(order=True)
class _Waiter:
    deadline: float
    order: int
    woken: asyncio.Future[None] = field(compare=False)


class Hold:
    """The one owner of the requests waiting for room; the router owns the counts that make room.
    ``place`` holds and places a request; ``done`` is told when it ends."""

    def __init__(
        self,
        router: ElasticRouter,
        max_s: float,
        ttft_ms: float | None,
        now: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.router = router  # read by the flow to place a request it let through
        self._max_s = max_s
        self._late_s = ttft_ms / 1000 * _LATE_SHARE if ttft_ms is not None else math.inf
        self._now = now
        self._sleep = sleep
        self._waiters: list[_Waiter] = []
        self._woken = 0  # woken, not yet placed: the room they were woken for is theirs
        self._order = itertools.count()
        self.num_held = 0  # requests that waited and were then let through, since start
        self.num_overdue = 0  # of those, placed after max_s without room
        self.held_s = 0.0  # their waiting, summed

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def place(
        self, members: Callable[[], Sequence[C]], prompt_tokens: int, max_tokens: int | None
    ) -> tuple[Placement[C], float]:
        """A request counted into the traffic on arrival, held while there is no room, then placed
        among ``members()`` (read after the wait: instances may have come or gone); and the seconds it
        waited. One step, so nothing runs between its turn and its placement."""
        arrival = self.router.arrive(prompt_tokens, max_tokens)
        held_s = await self.wait()
        placement = self.router.place(members(), prompt_tokens, max_tokens, arrival, len(self._waiters))
        return placement, held_s

    async def wait(self) -> float:
        """Return when a request arriving now may be placed: at once when there is room and nobody
        waits ahead, else when ``wake`` gives it a turn, or after ``max_s``. The caller places it before
        its next ``await`` (``place`` does both). Returns the seconds it waited."""
        if self._waiters:
            self.wake()  # room may have come without a request ending: a plan for less traffic
        if self._max_s <= 0 or (not self._waiters and self.router.room() - self._woken >= 1):
            return 0.0
        began = self._now()
        waiter = _Waiter(began + self._late_s, next(self._order), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.wake()  # the room kept from the late ones ahead is this request's
        timer = asyncio.ensure_future(self._sleep(self._max_s))
        try:
            await asyncio.wait((waiter.woken, timer), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._leave(waiter)
            self.wake()  # the turn it may have had goes to the next
            raise
        finally:
            timer.cancel()
        self.num_held += 1
        if not self._leave(waiter):
            self.num_overdue += 1
        waited = self._now() - began
        self.held_s += waited
        return waited

    def done(self, placement: Placement[C], measured: Measured | None = None) -> None:
        """A placed request ended: the router hears it (``ElasticRouter.done``), and its room goes on."""
        self.router.done(placement, measured)
        self.wake()

    def wake(self) -> None:
        """Room may have opened (a request ended, an instance left or came): turns for those waiting."""
        now = self._now()
        late_reserve: float | None = None  # the same for every late waiter: counted once, when one comes up
        while self._waiters:
            waiter = min(self._waiters, key=lambda w: (w.deadline < now, w))
            reserve = 0.0  # one that can still meet its TTFT leaves nothing to requests yet to come
            if waiter.deadline < now:
                if late_reserve is None:
                    late_reserve = _FRESH_RESERVE * self.router.expected_arrivals(self._late_s)
                reserve = late_reserve
            if self.router.room() - self._woken < 1 + reserve:
                return
            self._waiters.remove(waiter)
            waiter.woken.set_result(None)
            self._woken += 1

    def _leave(self, waiter: _Waiter) -> bool:
        """Take ``waiter`` out of the line; whether it had been woken (its reserved room is released)."""
        if waiter.woken.done():
            self._woken -= 1
            return True
        self._waiters.remove(waiter)
        waiter.woken.cancel()
        return False
