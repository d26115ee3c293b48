"""Where a request's time goes, as the proxy sees it, and the histograms /metrics serves of it.

    arrival ─queue─▶ admitted ─prefill─▶ params ─handoff gap─▶ decode sent ─decode first byte─▶
            first byte to the client (TTFT) ─ITL × n─▶ end

The handoff gap is the proxy's own share between the two calls (choosing decode, the lease guard, a
retry's backoff). Prefill and decode first byte are what the instances took, queueing inside vLLM
included; a decode first byte holds its KV pull. Each request fills one ``Timeline``; ``Timings`` keeps
the histograms. Cheap on purpose: a chunk costs one clock read and an addition.
"""

from __future__ import annotations

import bisect
import time
from typing import Final

# Seconds; from a 2-core CPU box (a few ms) to a loaded GPU pool (minutes of queueing).
BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
ITL_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """A Prometheus histogram: cumulative buckets rendered at scrape time."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        """Observations so far, summed at scrape time rather than counted on every token."""
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


PHASES: Final = {
    "queue": "Waiting for an admission slot.",
    "prefill": "The prefill call (queueing inside prefill included).",
    "handoff_gap": "Between prefill's answer and decode's request: the proxy's own time, retries included.",
    "decode_first_byte": "Decode's request until its first byte (its KV pull included).",
    "ttft": "Arrival until the client's first byte.",
    "e2e": "Arrival until the client's last byte.",
}


class Timings:
    """The histograms behind pdserve_<phase>_seconds and pdserve_itl_seconds."""

    def __init__(self) -> None:
        self.phases = {name: Histogram(BUCKETS) for name in PHASES}
        self.itl = Histogram(ITL_BUCKETS)
        self._in_order = tuple(self.phases.values())  # as ``Timeline.seconds`` lists the phases

    def observe(self, timeline: Timeline) -> None:
        """Count each phase the request went through, as ``Timeline.seconds`` measures them: once per
        request, so unrolled (no tuple, no loop) and each ``Histogram.observe`` inlined."""
        bucket = bisect.bisect_left
        queue, prefill, gap, decode, ttft, e2e = self._in_order
        t = timeline
        arrived, admitted, prefill_done, decode_sent = t.arrived, t.admitted, t.prefill_done, t.decode_sent
        if admitted is not None:
            seconds = admitted - arrived
            queue.counts[bucket(queue.bounds, seconds)] += 1
            queue.sum += seconds
        if prefill_done is not None:
            if t.prefill_sent is not None:
                seconds = prefill_done - t.prefill_sent
                prefill.counts[bucket(prefill.bounds, seconds)] += 1
                prefill.sum += seconds
            if decode_sent is not None:
                seconds = decode_sent - prefill_done
                gap.counts[bucket(gap.bounds, seconds)] += 1
                gap.sum += seconds
        if decode_sent is not None and t.decode_first_byte is not None:
            seconds = t.decode_first_byte - decode_sent
            decode.counts[bucket(decode.bounds, seconds)] += 1
            decode.sum += seconds
        if t.first_byte is not None:
            seconds = t.first_byte - arrived
            ttft.counts[bucket(ttft.bounds, seconds)] += 1
            ttft.sum += seconds
        if t.ended is not None:
            seconds = t.ended - arrived
            e2e.counts[bucket(e2e.bounds, seconds)] += 1
            e2e.sum += seconds


class Timeline:
    """One request's moments (time.perf_counter() seconds), filled in as it goes.

    Made for every request: its constructor sets what every request has, and each other moment reads as
    the class's default (None, or 0 for the gaps) until it happens."""

    admitted: float | None = None
    prefill_sent: float | None = None
    prefill_done: float | None = None
    decode_sent: float | None = None
    decode_first_byte: float | None = None
    first_byte: float | None = None  # to the client
    last_chunk: float | None = None
    ended: float | None = None
    num_gaps: int = 0
    gaps_sum: float = 0.0
    gap_max: float = 0.0

    def __init__(self, arrived: float, admitted: float | None = None, itl: Histogram | None = None) -> None:
        self.arrived = arrived
        self.admitted = admitted
        self.itl = itl  # where each gap between chunks is also counted

    def __repr__(self) -> str:
        return f"Timeline({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def chunk(self, now: float) -> None:
        """A chunk went to the client at ``now`` (once per token of a stream)."""
        last = self.last_chunk
        self.last_chunk = now
        if last is None:
            self.first_byte = now
            return
        gap = now - last
        itl = self.itl
        if itl is not None:  # Histogram.observe, inlined
            itl.counts[bisect.bisect_left(itl.bounds, gap)] += 1
            itl.sum += gap
        self.num_gaps += 1
        self.gaps_sum += gap
        if gap > self.gap_max:
            self.gap_max = gap

    def seconds(self) -> tuple[float | None, ...]:
        """Each phase's seconds in ``PHASES``' order, None for one that did not happen."""
        arrived, prefill_done, decode_sent = self.arrived, self.prefill_done, self.decode_sent
        admitted, prefill_sent, decode_first_byte = self.admitted, self.prefill_sent, self.decode_first_byte
        first_byte, ended = self.first_byte, self.ended
        return (
            None if admitted is None else admitted - arrived,
            None if prefill_sent is None or prefill_done is None else prefill_done - prefill_sent,
            None if prefill_done is None or decode_sent is None else decode_sent - prefill_done,
            None if decode_sent is None or decode_first_byte is None else decode_first_byte - decode_sent,
            None if first_byte is None else first_byte - arrived,
            None if ended is None else ended - arrived,
        )

    def spans(self) -> dict[str, float]:
        """Each phase's seconds, for those that happened."""
        return {name: s for name, s in zip(PHASES, self.seconds(), strict=True) if s is not None}

    def as_ms(self) -> dict[str, float]:
        out = {f"{k}_ms": round(v * 1000, 3) for k, v in self.spans().items()}
        if self.num_gaps:
            out["itl_mean_ms"] = round(self.gaps_sum / self.num_gaps * 1000, 3)
            out["itl_max_ms"] = round(self.gap_max * 1000, 3)
        return out


def now() -> float:
    return time.perf_counter()
