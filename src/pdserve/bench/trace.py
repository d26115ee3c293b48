"""A time-varying trace for the simulated cluster: phases of Poisson traffic, each with its own rate and
prompt and output lengths, and optional bursts; and what a replay of it scores, phase by phase.

A burst is a higher rate for the last ``duration_s`` of every ``period_s`` of its phase (the phase opens
at its base rate). Arrivals are Poisson within each stretch of constant rate, which is exact: gaps are
memoryless, so restarting them where the rate changes draws the same process.

Goodput is vLLM's, per phase: the requests that *arrived* in a phase and met both the TTFT and the TPOT
objective, divided by the phase's duration. A request that arrives near a phase's end and finishes in the
next (or after the trace, while the cluster drains: the replay waits for every request) still counts to
its own phase, so an arm that falls behind is charged in the phase that overloaded it, not the next.
Overall goodput is every good request over the trace's duration (the drain not counted as time).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.bench.load import percentile
from pdserve.errors import ConfigError
from pdserve.slo import Slo


@dataclass(frozen=True)
class Burst:
    """``rate`` requests/s for the last ``duration_s`` of every ``period_s`` of a phase."""

    period_s: float
    duration_s: float
    rate: float

    def __post_init__(self) -> None:
        if not (0 < self.duration_s <= self.period_s) or not self.rate > 0:
            raise ConfigError(f"a burst needs 0 < duration_s <= period_s and rate > 0, got {self}")


@dataclass(frozen=True)
class Phase:
    """``duration_s`` of Poisson arrivals at ``rate``/s of ``input_len`` fresh prompt tokens asking
    ``output_len`` tokens each; ``bursts``, if given, raise the rate for part of each period."""

    duration_s: float
    rate: float
    input_len: int
    output_len: int
    bursts: Burst | None = None

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.rate > 0 or self.input_len < 1 or self.output_len < 2:
            raise ConfigError(f"a phase needs duration, rate > 0, input_len >= 1, output_len >= 2: {self}")

    def stretches(self) -> list[tuple[float, float, float]]:
        """(start, end, rate) of the phase's stretches of constant rate, from its start."""
        if self.bursts is None:
            return [(0.0, self.duration_s, self.rate)]
        b, start = self.bursts, 0.0
        out: list[tuple[float, float, float]] = []
        while start < self.duration_s:
            calm_end = min(start + b.period_s - b.duration_s, self.duration_s)
            burst_end = min(start + b.period_s, self.duration_s)
            out.append((start, calm_end, self.rate))
            if burst_end > calm_end:
                out.append((calm_end, burst_end, b.rate))
            start += b.period_s
        return [s for s in out if s[1] > s[0]]

    def describe(self) -> str:
        burst = ""
        if self.bursts is not None:
            b = self.bursts
            burst = f", {b.duration_s:g} s bursts of {b.rate:g}/s every {b.period_s:g} s"
        return f"{self.duration_s:g} s of {self.rate:g}/s, {self.input_len} in / {self.output_len} out{burst}"


@dataclass(frozen=True)
class Arrival:
    index: int
    at: float  # seconds from the trace's start
    phase: int
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Trace:
    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("a trace needs at least one phase")

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def arrivals(self, seed: int = 0) -> list[Arrival]:
        """Every request of the trace in arrival order; the same seed gives the same list."""
        rng, offset = random.Random(seed), 0.0
        out: list[Arrival] = []
        for k, phase in enumerate(self.phases):
            for start, end, rate in phase.stretches():
                t = offset + start + rng.expovariate(rate)
                while t < offset + end:
                    out.append(Arrival(len(out), t, k, phase.input_len, phase.output_len))
                    t += rng.expovariate(rate)
            offset += phase.duration_s
        return out


class _Timed(Protocol):
    @property
    def duration_s(self) -> float: ...

    def describe(self) -> str: ...


class Traffic(Protocol):
    """What a replay needs of a trace: its phases' durations and its arrivals (``Trace`` here, or
    bench/mixed.py's ``MixedTrace``, whose requests each draw their own lengths)."""

    @property
    def phases(self) -> Sequence[_Timed]: ...

    @property
    def duration_s(self) -> float: ...

    def arrivals(self, seed: int = 0) -> list[Arrival]: ...


@dataclass(frozen=True)
class Served:
    """One request of a replay: its phase and latencies on the virtual clock."""

    phase: int
    ttft_s: float
    tpot_s: float
    split: bool


@dataclass(frozen=True)
class TraceRun:
    """One arm's replay of a trace: every request's record (goodput and drain: the module's docstring)."""

    arm: str
    trace: Traffic
    served: tuple[Served, ...]
    cpu_s: float = 0.0

    def _of(self, phase: int | None) -> list[Served]:
        return [s for s in self.served if phase is None or s.phase == phase]

    def goodput(self, slo: Slo, phase: int | None = None) -> float:
        """Requests (of ``phase``, or all) that met both objectives, per second of that phase (or trace)."""
        good = sum(1 for s in self._of(phase) if slo.meets(s.ttft_s, s.tpot_s))
        duration = self.trace.duration_s if phase is None else self.trace.phases[phase].duration_s
        return good / duration

    def quantile(self, field: str, q: float, phase: int | None = None) -> float:
        return percentile([getattr(s, field) for s in self._of(phase)], q)

    def split_share(self, phase: int | None = None) -> float:
        served = self._of(phase)
        return sum(s.split for s in served) / len(served) if served else 0.0
