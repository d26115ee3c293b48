"""Disaggregated against colocated, side by side: the ratios, and a verdict with its reasons.

Pure: two runs per request rate (the same workload on the same instances, split by the pdserve proxy
or served whole behind a plain router) and what the instances counted during each. Ratios are
disaggregated / colocated: below 1 the split is faster (latencies), above 1 it serves more (goodput,
throughput).

The verdict: with SLOs, goodput decides (DistServe's measure: requests per second that meet every SLO,
here on the same instances, so per instance too); without them, the medians of TTFT, TPOT and E2E
latency vote, and a split vote says so rather than pick. The reasons are what explains the numbers:
the KV transfer's share of TTFT, queueing (vLLM's waiting requests, and TTFT over the run's fastest,
unqueued TTFT), and interference (colocated ITL over disaggregated ITL: a prefill chunk in a colocated
step stalls every decode in it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from pdserve.bench.evidence import RunEvidence
from pdserve.bench.result import BenchResult
from pdserve.bench.workload import rate_arg

Mode = Literal["disaggregated", "colocated"]
MODES: Final[tuple[Mode, ...]] = ("disaggregated", "colocated")
Decision = Literal["disaggregate", "colocate", "either", "inconclusive"]
TOLERANCE: Final = 0.05  # differences within ±5 % are ties: runs on a shared machine vary that much

# (row name, metric, statistic): the side-by-side table, latencies in ms
_ROWS: Final = (
    ("TTFT p50 ms", "ttft", "median"), ("TTFT p90 ms", "ttft", "p90"), ("TTFT p99 ms", "ttft", "p99"),
    ("TPOT p50 ms", "tpot", "median"), ("TPOT p90 ms", "tpot", "p90"),
    ("ITL p50 ms", "itl", "median"), ("ITL p90 ms", "itl", "p90"), ("ITL p99 ms", "itl", "p99"),
    ("E2EL p50 ms", "e2el", "median"), ("E2EL p90 ms", "e2el", "p90"),
)  # fmt: skip


@dataclass(frozen=True)
class Arm:
    """One mode's run at one rate."""

    mode: Mode
    result: BenchResult
    evidence: RunEvidence | None = None


@dataclass(frozen=True)
class RatePair:
    """Both modes at one request rate: what the verdict compares."""

    rate: float
    disaggregated: Arm
    colocated: Arm


@dataclass(frozen=True)
class Row:
    name: str
    disaggregated: float
    colocated: float
    is_higher_better: bool

    @property
    def ratio(self) -> float:
        return _ratio(self.disaggregated, self.colocated)


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    headline: str
    reasons: tuple[str, ...]


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return math.nan if a == 0 else math.inf
    return a / b


def rows(pair: RatePair) -> list[Row]:
    d, c = pair.disaggregated.result, pair.colocated.result
    out = [Row(name, getattr(d.latency(m), s), getattr(c.latency(m), s), False) for name, m, s in _ROWS]
    if d.goodput is not None and c.goodput is not None:
        out.append(Row("goodput req/s", d.goodput, c.goodput, True))
    out.append(Row("requests/s", d.request_throughput, c.request_throughput, True))
    out.append(Row("output tokens/s", d.output_throughput, c.output_throughput, True))
    out.append(Row("failed", float(d.failed), float(c.failed), False))
    return out


def _geomean(values: Sequence[float]) -> float:
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, finite)) / len(finite)) if finite else math.nan


def _side(ratio: float, is_higher_better: bool) -> Decision:
    """Which side a disaggregated/colocated ratio favours, ties within TOLERANCE."""
    if math.isnan(ratio) or abs(ratio - 1) <= TOLERANCE:
        return "either"
    is_split_better = ratio > 1 if is_higher_better else ratio < 1
    return "disaggregate" if is_split_better else "colocate"


def decide(pairs: Sequence[RatePair]) -> Verdict:
    if not pairs:
        raise ValueError("no runs to compare")
    reasons = [*_transfer_reasons(pairs), *_queue_reasons(pairs), _interference_reason(pairs)]
    reasons += _failure_reasons(pairs)
    empty = [m for m in MODES if any(getattr(p, m).result.completed == 0 for p in pairs)]
    if empty:
        return Verdict("inconclusive", f"no request completed in a {' and a '.join(empty)} run: nothing to compare",
                       tuple(reasons))  # fmt: skip
    d_good = [p.disaggregated.result.goodput for p in pairs]
    c_good = [p.colocated.result.goodput for p in pairs]
    if all(g is not None for g in (*d_good, *c_good)):
        d_sum, c_sum = sum(g or 0.0 for g in d_good), sum(g or 0.0 for g in c_good)
        ratio = _ratio(d_sum, c_sum)
        decision = _side(ratio, is_higher_better=True)
        shown = "no request met the SLOs in either mode" if math.isnan(ratio) else f"{ratio:.2f}x"
        headline = f"goodput disaggregated/colocated {shown} (summed over {len(pairs)} rate(s))"
        return Verdict(decision, headline, tuple(reasons))
    votes = {}
    for name, metric in (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2EL", "e2el")):
        ratio = _geomean([_ratio(p.disaggregated.result.latency(metric).median,
                                 p.colocated.result.latency(metric).median) for p in pairs])  # fmt: skip
        votes[name] = (ratio, _side(ratio, is_higher_better=False))
    sides = {side for _, side in votes.values() if side != "either"}
    shown = ", ".join(f"{name} p50 {ratio:.2f}x" for name, (ratio, _) in votes.items())
    if len(sides) == 1:
        decision = sides.pop()
        headline = f"disaggregated/colocated: {shown}; no SLOs given, so the medians decide"
    else:
        decision = "either"
        why = "they disagree" if sides else "all within ±5 %"
        headline = (
            f"disaggregated/colocated: {shown}: {why}; give --goodput ttft:MS tpot:MS to decide by SLOs"
        )
    return Verdict(decision, headline, tuple(reasons))


def _transfer_reasons(pairs: Sequence[RatePair]) -> list[str]:
    evidence = [(p, p.disaggregated.evidence) for p in pairs if p.disaggregated.evidence is not None]
    if not evidence:
        return []
    count = sum(e.num_transfers for _, e in evidence)
    if count == 0:
        return ["transfer: decode counted no NIXL transfer during the disaggregated runs: the KV did not move "
                "over NIXL (prompts shorter than a block, or every request served whole?)"]  # fmt: skip
    seconds = sum(e.transfer_s_sum for _, e in evidence)
    size = sum(e.transfer_bytes_sum for _, e in evidence)
    mean_ms = seconds / count * 1000
    ttft = _geomean([p.disaggregated.result.ttft.median for p, _ in evidence])
    rate = f"{size / seconds / 1e9:.2f} GB/s" if seconds > 0 else "unmeasured"
    line = (f"transfer: {count} KV transfers, {size / count / 1e6:.2f} MB each, {mean_ms:.1f} ms mean ({rate}): "
            f"{mean_ms / ttft:.0%} of disaggregated TTFT p50 ({ttft:.1f} ms)")  # fmt: skip
    failed = sum(e.num_failed_transfers for _, e in evidence)
    lines = [line + (f"; {failed} transfers failed" if failed else "")]
    expired = sum(e.num_expired_leases for _, e in evidence)
    suspect = sum(e.num_suspect_handoffs for _, e in evidence)
    retries = sum(e.num_retries for _, e in evidence)
    if expired or suspect:
        lines.append(f"handoffs: {expired} KV leases expired before decode read them, {suspect} answers withheld "
                     f"and prefilled again, {retries} retries: decode fell a whole lease behind its prefill "
                     "(a starved core?), and those requests' latencies include that wait")  # fmt: skip
    elif retries:
        lines.append(f"handoffs: {retries} attempts retried on another instance (failed or too slow): "
                     "those requests' latencies include the attempt that did not answer")  # fmt: skip
    return lines


def _queue_reasons(pairs: Sequence[RatePair]) -> list[str]:
    lines = []
    for mode in MODES:
        parts = []
        for p in pairs:
            arm: Arm = getattr(p, mode)
            r = arm.result
            # Its fastest tenth waited for little: the median's excess over them is mostly queueing.
            fast = sorted(r.ttfts_ms)[len(r.ttfts_ms) // 10] if r.ttfts_ms else math.nan
            text = f"@{rate_arg(p.rate)}: TTFT p50 {r.ttft.median:.1f} ms"
            if not math.isnan(fast):
                text += f", {r.ttft.median - fast:.1f} ms over its p10"
            if arm.evidence is not None:
                loads = ", ".join(f"{pool} {q.waiting_mean:.1f} (max {q.waiting_max:g})"
                                  for pool, q in arm.evidence.queues.items())  # fmt: skip
                if loads:
                    text += f"; vLLM waiting mean: {loads}"
                phases = arm.evidence.proxy_ms
                if "prefill" in phases:
                    text += f"; prefill call {phases['prefill']:.1f} ms mean"
                if "prefill" in phases and "decode_first_byte" in phases:
                    # After the handoff: decode's pull of the KV, its wait for a step, its first token.
                    text += f", then decode's first byte {phases['decode_first_byte']:.1f} ms mean"
            parts.append(text)
        lines.append(f"queueing, {mode}: " + " | ".join(parts))
    return lines


def _interference_reason(pairs: Sequence[RatePair]) -> str:
    p90 = _geomean([_ratio(p.colocated.result.itl.p90, p.disaggregated.result.itl.p90) for p in pairs])
    p50 = _geomean([_ratio(p.colocated.result.itl.median, p.disaggregated.result.itl.median) for p in pairs])
    if math.isnan(p90):
        return "interference: no ITL measured (one output token per request?)"
    if p90 > 1 + TOLERANCE:
        return (
            f"interference: colocated ITL p90 is {p90:.2f}x disaggregated (p50 {p50:.2f}x): prefills "
            "share colocated steps with decodes and stall them; a decode-only instance avoids that"
        )
    return f"interference: colocated ITL p90 {p90:.2f}x disaggregated (p50 {p50:.2f}x): prefills do not visibly slow decodes here"


def _failure_reasons(pairs: Sequence[RatePair]) -> list[str]:
    out = []
    for mode in MODES:
        failed = sum(getattr(p, mode).result.failed for p in pairs)
        if failed:
            error = next(
                (getattr(p, mode).result.first_error for p in pairs if getattr(p, mode).result.first_error),
                None,
            )
            out.append(f"failures: {failed} {mode} requests failed" + (f", first: {error}" if error else ""))
    return out


def render(pairs: Sequence[RatePair], verdict: Verdict) -> list[str]:
    """The side-by-side table per rate, then the verdict and its reasons, as lines for the terminal."""
    lines = []
    for p in pairs:
        lines.append(f"rate {rate_arg(p.rate)} req/s{'':<9}{'disaggregated':>14}{'colocated':>12}{'d/c':>8}")
        for row in rows(p):
            shown_d, shown_c = round(row.disaggregated, 2), round(row.colocated, 2)
            # A ratio against a column that reads 0.00 (vLLM's client timing a 0.004 ms gap) would print
            # as a four-digit number nobody can check against the table: it reads as the table does.
            ratio = _ratio(shown_d, shown_c) if 0 in (shown_d, shown_c) else row.ratio
            mark = "" if math.isnan(ratio) or row.name == "failed" else f"{ratio:8.2f}"
            lines.append(f"  {row.name:<22}{row.disaggregated:>14.2f}{row.colocated:>12.2f}{mark}")
    lines.append(f"verdict: {verdict.decision.upper()}: {verdict.headline}")
    lines += [f"  - {reason}" for reason in verdict.reasons]
    return lines
