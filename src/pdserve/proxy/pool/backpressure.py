"""Back-pressure from decode to prefill: a split request is prefilled only when its decode will keep the
KV's lease alive until it pulls; otherwise it waits at the proxy, at most ``max_wait_s`` (then 503).

What loses a lease (vLLM's NIXL connector): prefill pins a handoff's KV for the lease from its answer on.
Decode renews it from the moment its engine core receives the request (``on_new_request``): at most one
heartbeat per lease/6 s (``lease // 6``), sent only when its scheduler steps, each extending the lease to
2/3 of it from then. A handoff queued behind many others at a decode that steps is safe however long it
waits, so decode's time to first token says nothing of the risk. The KV is at risk only

- on its way in: from prefill's answer until decode's engine has the request (the proxy, decode's API
  server tokenizing it, the engine taking it in between two steps), and
- while decode's scheduler does not step: a gap near half the lease between heartbeats loses it.

The rule, per decode (``Intake``), asked once per prefill round (``admit``, then ``wait``):

- the way in: a stream's time from prefill's answer to decode's status line (vLLM's API server has
  tokenized and checked the request and gives it to its engine next), a moving average, and no less
  than the age of the oldest stream's KV whose status line has not come;
- the step gap: the longest gap between a stream's tokens (one per step), a moving average over the
  streams that ended, and no less than how long decode has shown no sign of stepping while the proxy has
  requests there (``Instance.silence_s``), less the scrape interval by which that sign may lag;
- exposure: the longest a new handoff's KV would go unrenewed, as a share of what holds it: the way in,
  a heartbeat period and a gap against the whole lease; a period and a gap against the 2/3 a heartbeat
  gives (so: the greater of the first sum and 3/2 of the second);
- room: nothing ahead (one handoff always goes, so a decode is measured again), or exposure within
  ``SHARE`` of the lease. A busy decode that steps admits everyone; a stalled or pathologically slow one
  holds requests here. Those waiting go first come, first served, as room opens.

Nothing is judged while nothing waits and nothing is ahead at that decode: ``admit`` is then a lookup and
a count. No HTTP and no asyncio beyond the waiters' futures; the clock is given.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Final, NamedTuple, Protocol

from pdserve.errors import DecodeBacklogged, UpstreamTimeout
from pdserve.proxy.record.timeline import BUCKETS, Histogram, Timeline

# The share of the lease a handoff's KV may expect to go unrenewed: "well within" leaves the rest for a
# step slower than any measured, a way in longer than the average, a step the scrape has not shown yet.
SHARE: Final = 0.5
_WEIGHT = 0.3  # of each new measurement in the moving averages
_RECHECK_S = 0.5  # a waiter looks again this often: room also opens as decode shows it steps


class Decode(Protocol):
    """What the rule reads of a decode instance (``Instance``)."""

    url: str

    def silence_s(self, now: float) -> float: ...


class Ticket:
    """One request's place in a decode's intake, from its admission until decode's answer begins."""

    __slots__ = ("_intake", "_kv_at", "is_held")

    def __init__(self, intake: Intake | None) -> None:
        self._intake = intake
        self._kv_at: float | None = None  # when prefill's answer came, until decode's status line
        self.is_held = intake is not None

    def kv_arrived(self, is_stream: bool) -> None:
        """Prefill answered: the KV waits for decode under its lease from now. A stream's status line will
        say when decode's API server had it; a whole answer's comes only after every token, so a whole
        request holds no place from here (what it measures, its stream neighbours measure too)."""
        if not self.is_held:
            return
        intake = self._intake
        assert intake is not None
        if not is_stream:
            self.release()
        elif self._kv_at is None:
            self._kv_at = now = intake.now()
            intake.on_way[self] = now

    def reached(self) -> None:
        """Decode's status line came: its API server has the request and hands it to its engine."""
        kv_at = self._kv_at
        if kv_at is not None:
            self._kv_at = None
            intake = self._intake
            assert intake is not None
            intake.on_way.pop(self, None)
            intake.way_measured(intake.now() - kv_at)

    def began(self) -> None:
        """Decode's answer began: the request is no longer ahead of anyone there."""
        if self.is_held:
            self.release()

    def ended(self, timeline: Timeline) -> None:
        """The request is over; a stream's longest gap between tokens measures decode's steps (not when
        the client's first chunk came before decode's: that gap is the hand-over's)."""
        intake = self._intake
        if intake is None:
            return
        if self.is_held:
            self.release()
        first, decode_first = timeline.first_byte, timeline.decode_first_byte
        if timeline.num_gaps and first is not None and decode_first is not None and first >= decode_first:
            intake.gap_measured(timeline.gap_max)

    def release(self) -> None:
        """No longer ahead of anyone at that decode (its answer began, or the request went elsewhere or
        ended); idempotent."""
        if not self.is_held:
            return
        self.is_held = False
        intake = self._intake
        assert intake is not None
        intake.num_ahead -= 1
        if self._kv_at is not None:
            self._kv_at = None
            intake.on_way.pop(self, None)
        if intake.waiters:
            intake.pump()


NO_TICKET: Final = Ticket(None)  # a request that holds no place anywhere (not split, or not yet)


class Waited(NamedTuple):
    """A request's turn came: its ticket, the seconds it waited, and why it had to."""

    ticket: Ticket
    seconds: float
    why: str


class Intake:
    """One decode's handoffs ahead, its measured way in and step gap; its waiters, first come first served."""

    def __init__(
        self, decode: Decode, lease_s: float, scrape_every_s: float, now: Callable[[], float]
    ) -> None:
        self.url = decode.url
        self.decode = decode
        self.budget_s = lease_s * SHARE
        self.heartbeat_every_s = float(int(lease_s) // 6)  # vLLM's throttle: kv_lease_duration // 6
        self._scrape_every_s = scrape_every_s
        self.now = now
        self.num_ahead = 0  # tickets held: prefilling, or KV waiting for decode's answer to begin
        # streams' KV whose decode status line has not come → since when (oldest first)
        self.on_way: dict[Ticket, float] = {}
        self.way_s = 0.0  # from prefill's answer to decode's status line: the moving average
        self.gap_s = 0.0  # a stream's longest gap between tokens: the moving average
        self.waiters: deque[asyncio.Future[Ticket]] = deque()

    def way_measured(self, seconds: float) -> None:
        self.way_s += _WEIGHT * (seconds - self.way_s)

    def gap_measured(self, seconds: float) -> None:
        self.gap_s += _WEIGHT * (seconds - self.gap_s)

    def way_in_s(self) -> float:
        """How long a handoff takes to reach decode's API server, as measured and as waiting now."""
        on_way = self.on_way
        oldest = self.now() - next(iter(on_way.values())) if on_way else 0.0
        return max(self.way_s, oldest)

    def step_gap_s(self) -> float:
        """The gap between decode's scheduler steps, as measured and as silent now."""
        return max(self.gap_s, self.decode.silence_s(self.now()) - self._scrape_every_s)

    def exposure_s(self) -> float:
        """The longest a handoff admitted now would have its KV go unrenewed, scaled to the lease (the
        second term's 3/2: a heartbeat's 2/3 of the lease against the whole lease of the first)."""
        renewal = self.heartbeat_every_s + self.step_gap_s()
        return max(self.way_in_s() + renewal, 1.5 * renewal)

    def has_room(self) -> bool:
        return self.num_ahead == 0 or self.exposure_s() <= self.budget_s

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
        return (f"decode {self.url}: {self.num_ahead} handoff(s) ahead; its way in ~{self.way_in_s():.1f} s, "
                f"its steps ~{self.step_gap_s():.1f} s apart: a new KV would go ~{self.exposure_s():.1f} s "
                f"unrenewed, over {self.budget_s:g} s ({SHARE:g} of the KV lease)")  # fmt: skip


class Backpressure:
    """Every decode's intake, and the waits of requests held for one; what /metrics shows of them."""

    def __init__(
        self,
        lease_s: float,
        max_wait_s: float,
        now: Callable[[], float] = time.monotonic,
        scrape_every_s: float = 2.0,
    ) -> None:
        """``scrape_every_s``: how often the proxy reads the instances' /metrics (a stepping decode's
        token counters may look still for that long)."""
        self.lease_s = lease_s
        self.max_wait_s = max_wait_s
        self._now = now
        self._scrape_every_s = scrape_every_s
        self._intakes: dict[str, Intake] = {}
        self.num_waiting = 0
        self.results: dict[str, int] = {"admitted": 0, "timed_out": 0, "gone": 0}  # of requests that waited
        self.waits = Histogram(BUCKETS)  # the seconds each waiting request waited

    @property
    def intakes(self) -> list[Intake]:
        return list(self._intakes.values())

    def intake(self, decode: Decode) -> Intake:
        intake = self._intakes.get(decode.url)
        if intake is None:
            intake = self._intakes[decode.url] = Intake(decode, self.lease_s, self._scrape_every_s, self._now)
        elif intake.decode is not decode:  # the same URL, a new instance (removed and added again)
            intake.decode = decode
        return intake

    def admit(self, decode: Decode) -> Ticket | None:
        """A ticket at once when ``decode`` has room and nobody waits there before; None: wait."""
        if self.max_wait_s <= 0:
            return NO_TICKET  # back-pressure off: prefill at once, hold no place
        intake = self._intakes.get(decode.url)
        if intake is None or intake.decode is not decode:
            intake = self.intake(decode)
        if intake.waiters:
            intake.pump()
            if intake.waiters:
                return None
        if intake.num_ahead and intake.exposure_s() > intake.budget_s:
            return None
        intake.num_ahead += 1
        return Ticket(intake)

    async def wait(self, decode: Decode, deadline: float, request_s: float) -> Waited:
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
                    self.intake(decode).pump()  # decode may have stepped, or the oldest KV reached it
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
