"""The side-by-side table and the verdict of `pdserve bench --compare`, from plain results."""

from __future__ import annotations

import dataclasses
import math

from pdserve.bench.evidence import PoolLoad, RunEvidence
from pdserve.bench.result import BenchResult, Latency
from pdserve.bench.verdict import Arm, RatePair, decide, render, rows


def result(label: str, ttft: float, tpot: float, itl_p90: float | None = None, goodput: float | None = None,
           completed: int = 10, failed: int = 0, error: str | None = None) -> BenchResult:  # fmt: skip
    """A run whose every request saw ``ttft`` and ``tpot`` (ms), ITL p90 ``itl_p90`` (default: tpot)."""
    itl = Latency(tpot, tpot, itl_p90 or tpot, itl_p90 or tpot)
    e2e = ttft + 15 * tpot
    return BenchResult(
        label=label, request_rate=4.0, max_concurrency=None, completed=completed, failed=failed, duration_s=2.5,
        request_throughput=completed / 2.5, output_throughput=completed * 16 / 2.5, goodput=goodput,
        mean_input_len=512, mean_output_len=16, ttft=Latency(ttft, ttft, ttft * 1.5, ttft * 2),
        tpot=Latency(tpot, tpot, tpot, tpot), itl=itl, e2el=Latency(e2e, e2e, e2e, e2e),
        ttfts_ms=tuple(ttft * (0.5 + i / 10) for i in range(completed)), itls_ms=(tpot,) * completed * 15,
        e2els_ms=(e2e,) * completed, first_error=error,
    )  # fmt: skip


def evidence(num: int = 10, seconds: float = 0.5, size: float = 1e9, waiting: float = 0.0) -> RunEvidence:
    queues = {"prefill": PoolLoad(waiting, waiting * 2, 1.0, 20), "decode": PoolLoad(0.0, 0.0, 3.0, 20)}
    return RunEvidence(num_transfers=num, num_failed_transfers=0, transfer_s_sum=seconds,
                       transfer_bytes_sum=size, proxy_ms={"prefill": 40.0, "decode_first_byte": 25.0}, queues=queues)  # fmt: skip


def pair(d: BenchResult, c: BenchResult, ev: RunEvidence | None = None, rate: float = 4.0) -> RatePair:
    return RatePair(rate, Arm("disaggregated", d, ev), Arm("colocated", c))


def test_with_slos_goodput_decides() -> None:
    p = pair(result("d", 100, 20, goodput=3.0), result("c", 80, 40, goodput=1.5), evidence())
    verdict = decide([p])
    assert verdict.decision == "disaggregate"
    assert "goodput disaggregated/colocated 2.00x" in verdict.headline
    goodput = next(r for r in rows(p) if r.name == "goodput req/s")
    assert (goodput.disaggregated, goodput.colocated, goodput.ratio) == (3.0, 1.5, 2.0)


def test_goodput_within_five_percent_is_a_tie() -> None:
    p = pair(result("d", 100, 20, goodput=3.0), result("c", 80, 40, goodput=3.1))
    assert decide([p]).decision == "either"


def test_without_slos_the_medians_vote_and_a_split_vote_says_so() -> None:
    slower = pair(result("d", 200, 30), result("c", 100, 20))
    assert decide([slower]).decision == "colocate"
    assert "no SLOs given, so the medians decide" in decide([slower]).headline
    split = decide([pair(result("d", 200, 10), result("c", 100, 20))])
    assert split.decision == "either"
    assert "TTFT p50 2.00x" in split.headline and "TPOT p50 0.50x" in split.headline
    assert "give --goodput ttft:MS tpot:MS" in split.headline


def test_a_mode_where_nothing_completed_is_inconclusive() -> None:
    p = pair(result("d", 0, 0, completed=0, failed=10, error="502 Bad Gateway"), result("c", 100, 20))
    verdict = decide([p])
    assert verdict.decision == "inconclusive"
    assert "disaggregated" in verdict.headline
    assert any(
        "failures: 10 disaggregated requests failed, first: 502 Bad Gateway" in r for r in verdict.reasons
    )


def test_the_transfer_reason_gives_size_time_bandwidth_and_share_of_ttft() -> None:
    p = pair(result("d", 100, 20), result("c", 100, 20), evidence(num=10, seconds=0.5, size=1e9))
    transfer = decide([p]).reasons[0]
    # 10 transfers of 100 MB in 0.5 s: 50 ms each at 2 GB/s, half of the 100 ms TTFT.
    assert transfer.startswith("transfer: 10 KV transfers, 100.00 MB each, 50.0 ms mean (2.00 GB/s): 50%")


def test_no_transfer_during_the_split_runs_is_called_out() -> None:
    p = pair(result("d", 100, 20), result("c", 100, 20), evidence(num=0, seconds=0.0, size=0.0))
    assert "the KV did not move over NIXL" in decide([p]).reasons[0]


def test_queueing_reasons_show_vllms_waiting_requests_and_the_prefill_call() -> None:
    p = pair(result("d", 100, 20), result("c", 100, 20), evidence(waiting=2.5))
    queueing = next(r for r in decide([p]).reasons if r.startswith("queueing, disaggregated"))
    assert "prefill 2.5 (max 5)" in queueing
    assert "prefill call 40.0 ms mean, then decode's first byte 25.0 ms mean" in queueing
    assert "over its p10" in queueing


def test_interference_is_named_when_colocated_decodes_stall() -> None:
    stalled = pair(result("d", 100, 20), result("c", 100, 20, itl_p90=60))
    assert any("colocated ITL p90 is 3.00x disaggregated" in r for r in decide([stalled]).reasons)
    calm = pair(result("d", 100, 20), result("c", 100, 20))
    assert any("do not visibly slow decodes" in r for r in decide([calm]).reasons)


def test_the_table_shows_both_modes_and_their_ratio_per_rate() -> None:
    pairs = [pair(result("d", 100, 20), result("c", 50, 40), rate=r) for r in (2.0, math.inf)]
    lines = render(pairs, decide(pairs))
    assert lines[0].split() == ["rate", "2", "req/s", "disaggregated", "colocated", "d/c"]
    assert any(line.split() == ["TTFT", "p50", "ms", "100.00", "50.00", "2.00"] for line in lines)
    assert any(line.split() == ["TPOT", "p50", "ms", "20.00", "40.00", "0.50"] for line in lines)
    assert any(line.startswith("rate inf req/s") for line in lines)
    assert any(line.startswith("verdict: ") for line in lines)


def test_a_column_that_reads_0_00_gets_the_ratio_the_table_shows() -> None:
    # vLLM's client times merged stream events as 0.004 ms gaps: 9.53 over that is not a ratio to print.
    pairs = [pair(result("d", 100, 9.53), result("c", 100, 0.004))]
    lines = render(pairs, decide(pairs))
    assert any(line.split() == ["TPOT", "p50", "ms", "9.53", "0.00", "inf"] for line in lines)
    both_tiny = [pair(result("d", 100, 0.003), result("c", 100, 0.001))]
    assert any(
        line.split() == ["TPOT", "p50", "ms", "0.00", "0.00"] for line in render(both_tiny, decide(both_tiny))
    )


def test_expired_leases_and_re_prefills_during_the_split_runs_are_reported() -> None:
    repaired = dataclasses.replace(evidence(), num_expired_leases=2, num_suspect_handoffs=2, num_retries=3)
    reasons = decide([pair(result("d", 100, 20), result("c", 100, 20), repaired)]).reasons
    assert any(
        r.startswith("handoffs: 2 KV leases expired before decode read them, 2 answers withheld")
        for r in reasons
    )
    retried = dataclasses.replace(evidence(), num_retries=1)
    reasons = decide([pair(result("d", 100, 20), result("c", 100, 20), retried)]).reasons
    assert any(r.startswith("handoffs: 1 attempts retried on another instance") for r in reasons)
    calm = decide([pair(result("d", 100, 20), result("c", 100, 20), evidence())]).reasons
    assert not any(r.startswith("handoffs:") for r in calm)
