"""Back-pressure from decode to prefill: a split request is prefilled only when its decode can pull the KV
well within prefill's lease; otherwise it waits at the proxy, at most ``max_wait_s`` (then 503).

Prefill pins a handoff's KV for the lease from the moment it answers, and decode's heartbeats extend it
only once decode's engine has the request. When the proxy prefills faster than decode takes handoffs in,
decode's queue outlives the lease: the KV expires unread, the lease guard withholds the answer, and the
fresh prefill that follows joins the same queue. KV computed only to expire is work lost twice; held at
the proxy, the request costs nothing until decode can take it.

The rule, per decode (``Intake``), asked once per prefill round (``admit``, then ``wait``):

- ahead: the handoffs the proxy has sent toward that decode whose answer has not begun (prefilling, or
  a stream's KV waiting for decode's first token), or the engine's own waiting count at the last scrape
  when that is more (whole answers, whose first token the proxy does not see; other proxies' requests;
  direct traffic);
- seconds per handoff ahead: decode's measured time from prefill's answer to its first byte, divided by
  the handoffs queued there when the KV arrived (streams, measured by the proxy), and the engine's own
  time to first token over each scrape interval divided by its queue then (every request, whole answers
  included: their first token is not seen by the proxy); a moving average;
- the wait a new handoff would have: (ahead + 1) x seconds per handoff, and no less than the age of the
  oldest KV still waiting there (a stalled decode measures nothing);
- room: nothing ahead (one handoff always goes, so a queue always drains and measures), or that wait
  within ``SHARE`` of the lease. Those waiting go first come, first served, as handoffs begin.

No HTTP and no asyncio beyond the waiters' futures; the clock is given.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Final, NamedTuple

from pdserve.errors import DecodeBacklogged, UpstreamTimeout
from pdserve.proxy.pool.instance import EngineLoad, Instance
from pdserve.proxy.record.timeline import BUCKETS, Histogram

# The part of the lease a handoff may expect to wait for decode: "well within" leaves the rest for a
# queue that grows faster than measured, a slower step, a scrape that is 2 s old.
SHARE: Final = 0.5
_WEIGHT = 0.3  # of each new measurement in the moving average
_RECHECK_S = 0.5  # a waiter looks again this often: room also opens as decode's scrapes show it


class Ticket:
    """One request's place in a decode's intake, from its admission until decode's answer begins."""

    __slots__ = ("_intake", "_kv_at", "_num_queued", "is_held")

    def __init__(self, intake: Intake | None) -> None:
        self._intake = intake
        self._kv_at: float | None = None  # when prefill's answer (the KV under its lease) came
        self._num_queued = 0  # the handoffs queued at decode then, this one included
        self.is_held = intake is not None

    def kv_arrived(self, is_stream: bool) -> None:
        """Prefill answered: the KV waits for decode under its lease from now. A stream's first byte
        will say when decode had it; a whole answer's comes only after every token, so once decode has
        a whole request, the engine's own waiting count stands for it (a long answer is not a queue)."""
        intake = self._intake
        if not is_stream:
            self.release()
        elif self.is_held and intake is not None and self._kv_at is None:
            self._kv_at = now = intake.now()
            intake.queued[self] = now
            self._num_queued = max(len(intake.queued), intake.engine_waiting + 1)

    def began(self, measure: bool) -> None:
        """Decode's answer began; ``measure``: its first byte is its first token (a stream), so the
        time since prefill answered is the handoff's time in decode's queue."""
        intake = self._intake
        if self.is_held and intake is not None and measure and self._kv_at is not None:
            intake.measured((intake.now() - self._kv_at) / self._num_queued)
        self.release()

    def release(self) -> None:
        """No longer ahead of anyone at that decode (its answer began, or the request went elsewhere or
        ended); idempotent."""
        intake = self._intake
        if not self.is_held or intake is None:
            return
        self.is_held = False
        intake.num_ahead -= 1
        intake.queued.pop(self, None)
        intake.pump()


NO_TICKET: Final = Ticket(None)  # a request that holds no place anywhere (not split, or not yet)


class Waited(NamedTuple):
    """A request's turn came: its ticket, the seconds it waited, and why it had to."""

    ticket: Ticket
    seconds: float
    why: str


class Intake:
    """One decode's handoffs ahead and its measured pace; its waiters, first come first served."""

    def __init__(self, url: str, budget_s: float, now: Callable[[], float]) -> None:
        self.url = url
        self.budget_s = budget_s
        self.now = now
        self.num_ahead = 0  # tickets held: prefilling, or KV waiting for decode's answer to begin
        self.queued: dict[Ticket, float] = {}  # tickets whose KV waits at decode → since (oldest first)
        self.per_handoff_s: float | None = None  # the moving average; None until measured
        self.engine_waiting = 0  # the engine's waiting count at the last scrape read
        self.last_load: EngineLoad | None = None  # the last scrape read (its TTFT counters)
        self.waiters: deque[asyncio.Future[Ticket]] = deque()

    def measured(self, per_handoff_s: float) -> None:
        old = self.per_handoff_s
        self.per_handoff_s = per_handoff_s if old is None else old + _WEIGHT * (per_handoff_s - old)

    def read(self, load: EngineLoad) -> None:
        """The engine's latest scrape: its queue, and its time to first token since the one before."""
        last, self.last_load = self.last_load, load
        self.engine_waiting = int(load.num_waiting)
        if last is None or load.ttft_count <= last.ttft_count:  # the first, or a restart reset the counters
            return
        mean_ttft = (load.ttft_sum - last.ttft_sum) / (load.ttft_count - last.ttft_count)
        self.measured(mean_ttft / ((last.num_waiting + load.num_waiting) / 2 + 1))

    def expected_s(self) -> float:
        """The wait a handoff admitted now would have at this decode (0 until measured)."""
        per = self.per_handoff_s or 0.0
        ahead = max(self.num_ahead, self.engine_waiting)
        oldest = self.now() - next(iter(self.queued.values())) if self.queued else 0.0
        return max((ahead + 1) * per, oldest)

    def has_room(self) -> bool:
        return self.num_ahead == 0 or self.expected_s() <= self.budget_s

    def take(self) -> Ticket:
        self.num_ahead += 1
        return Ticket(self)

    def pump(self) -> None:
        """Turns for those waiting, in order, while there is room."""
        waiters = self.waiters
        while waiters and waiters[0].done():  # gone (client left, timed out)
            waiters.popleft()
        while waiters and self.has_room():
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(self.take())

    def why(self) -> str:
        ahead = max(self.num_ahead, self.engine_waiting)
        return (f"decode {self.url}: {ahead} handoff(s) ahead, a new one would wait ~{self.expected_s():.1f} s "
                f"for its KV to be pulled, over {self.budget_s:g} s ({SHARE:g} of the KV lease)")  # fmt: skip


class Backpressure:
    """Every decode's intake, and the waits of requests held for one; what /metrics shows of them."""

    def __init__(self, lease_s: float, max_wait_s: float, now: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.max_wait_s = max_wait_s
        self._now = now
        self._intakes: dict[str, Intake] = {}
        self.num_waiting = 0
        self.results: dict[str, int] = {"admitted": 0, "timed_out": 0, "gone": 0}  # of requests that waited
        self.waits = Histogram(BUCKETS)  # the seconds each waiting request waited

    @property
    def intakes(self) -> list[Intake]:
        return list(self._intakes.values())

    def intake(self, decode: Instance) -> Intake:
        intake = self._intakes.get(decode.url)
        if intake is None:
            intake = self._intakes[decode.url] = Intake(decode.url, self.lease_s * SHARE, self._now)
        if decode.load is not intake.last_load:  # a new scrape (a fresh instance's is all zeros)
            intake.read(decode.load)
        return intake

    def admit(self, decode: Instance) -> Ticket | None:
        """A ticket at once when ``decode`` has room and nobody waits there before; None: wait."""
        if self.max_wait_s <= 0:
            return NO_TICKET  # back-pressure off: prefill at once, hold no place
        intake = self.intake(decode)
        intake.pump()
        if intake.waiters or not intake.has_room():
            return None
        return intake.take()

    async def wait(self, decode: Instance, deadline: float, request_s: float) -> Waited:
        """Wait for ``decode`` to have room, first come first served: at most ``max_wait_s``, and not
        past the request's ``deadline`` (monotonic; ``request_s`` its limit, for the message). Raises
        ``DecodeBacklogged`` (503) past the limit, ``UpstreamTimeout`` past the deadline."""
        intake = self.intake(decode)
        why = intake.why()
        began = self._now()
        limit_at = min(began + self.max_wait_s, deadline)
        turn: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        intake.waiters.append(turn)
        self.num_waiting += 1
        result = "gone"
        try:
            while not turn.done():
                left = limit_at - self._now()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(asyncio.shield(turn), min(_RECHECK_S, left))
                except TimeoutError:
                    self.intake(decode).pump()  # the scrape may have moved, or the oldest KV began
            if not turn.done():
                turn.cancel()
                result = "timed_out"
                waited = self._now() - began
                if limit_at >= deadline:
                    raise UpstreamTimeout("decode", decode.url, f"the request's {request_s:g} s deadline "
                                          f"passed while it waited {waited:.1f} s for room at decode; {why}")  # fmt: skip
                raise DecodeBacklogged(decode.url, waited, self.max_wait_s, why)
            result = "admitted"
            return Waited(turn.result(), self._now() - began, why)
        finally:
            self.num_waiting -= 1
            self.results[result] += 1
            self.waits.observe(self._now() - began)
            if result == "gone" and turn.done() and not turn.cancelled():
                turn.result().release()  # its turn came as the client left: the next one's
            elif not turn.done():
                turn.cancel()
