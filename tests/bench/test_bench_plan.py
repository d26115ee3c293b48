"""`pdserve plan` against the simulator: the P:D ratio it recommends serves the target within the SLOs
with the best goodput per instance of its neighbourhood, and over a slow link it says "colocate" and the
simulator agrees.

Goodput here is DistServe's at the target rate: the requests per second that met both SLOs, on the
simulated cluster (bench/simcluster.py: the simulator's scheduler and step costs on a virtual clock),
divided by the instances used. The workload is long prompts and short answers under a tight TPOT SLO
on Llama-3-8B/A100 shapes, where prefill chunks in colocated steps stall decodes."""

from __future__ import annotations

import pytest

from pdserve.bench import simcluster
from pdserve.bench.plan import PlanRequest, plan
from pdserve.errors import ConfigError
from pdserve.sim.profile import load_profile
from pdserve.slo import Slo

A100 = load_profile("llama3-8b-a100")
SLO = Slo(ttft_ms=1000, tpot_ms=20)
TARGET = PlanRequest(rate=5.0, input_len=4096, output_len=64, slo=SLO)
NUM_REQUESTS = 150


def simulate(profile_gbps: float | None, num_prefill: int, num_decode: int) -> simcluster.ClusterRun:
    profile = A100 if profile_gbps is None else A100.with_kv_bandwidth(profile_gbps * 1e9)
    load = simcluster.ClusterLoad(num_prefill, num_decode, TARGET.rate, TARGET.input_len, TARGET.output_len,
                                  num_requests=NUM_REQUESTS)  # fmt: skip
    return simcluster.run(profile, load)


def test_the_recommended_ratio_beats_one_more_prefill_one_more_decode_and_colocation() -> None:
    result = plan(A100, TARGET)
    assert result.decision == "disaggregate"
    rec = result.recommended
    assert rec is not None and (rec.num_prefill, rec.num_decode) == (2, 1)
    assert "plan: DISAGGREGATE 2P1D (P:D = 2:1)" in result.lines
    x, y = rec.num_prefill, rec.num_decode
    chosen = simulate(None, x, y)
    assert chosen.attainment(SLO) >= TARGET.attainment
    best = chosen.goodput_per_instance(SLO)
    for neighbour in ((x + 1, y), (x, y + 1)):
        assert simulate(None, *neighbour).goodput_per_instance(SLO) < best, neighbour
    # One prefill fewer is not enough: the ratio is not padded.
    fewer = simulate(None, x - 1, y)
    assert fewer.attainment(SLO) < TARGET.attainment and fewer.goodput_per_instance(SLO) < best
    # The same instances serving whole requests: the long prefills stall the decodes past the TPOT SLO.
    same_count = simulate(None, 0, x + y)
    assert same_count.attainment(SLO) < TARGET.attainment and same_count.goodput_per_instance(SLO) < best


def test_over_a_slow_link_the_plan_says_colocate_and_the_simulator_agrees() -> None:
    # 0.5 GB/s (NIXL over TCP loopback, as measured on an H200): a 4,096-token prompt's 537 MB take 1.07 s.
    slow = plan(A100, PlanRequest(**{**TARGET.__dict__, "kv_bandwidth_bytes_per_s": 0.5e9}))
    assert slow.decision == "colocate" and slow.disaggregated is None
    assert slow.transfer_s == pytest.approx(1.075, abs=0.01)
    assert any(line.startswith("split TTFT cannot go below 1384.6 ms") for line in slow.lines)
    assert slow.lines[-1].startswith("plan: COLOCATE")
    colocated = slow.recommended
    assert colocated is not None and colocated.num_prefill == 0
    whole = simulate(0.5, 0, colocated.num_decode)
    assert whole.attainment(SLO) >= TARGET.attainment
    # The fast link's plan and a split of the colocated instance count both miss TTFT on the slow link.
    for x, y in ((2, 1), (colocated.num_decode // 2, colocated.num_decode - colocated.num_decode // 2)):
        split = simulate(0.5, x, y)
        assert split.attainment(SLO) < 0.5, (x, y)
        assert split.goodput_per_instance(SLO) < whole.goodput_per_instance(SLO), (x, y)


def test_the_plan_gives_the_numbers_behind_it() -> None:
    result = plan(A100, TARGET)
    assert result.prefill_s == pytest.approx(0.288, abs=0.001)  # 2 chunks of 2,048 tokens
    assert result.kv_bytes == 4096 * 131072
    text = "\n".join(result.lines)
    assert "prefill 288.0 ms on an idle instance; its KV 536.9 MB" in text
    assert "disaggregated: 2P1D serves up to" in text and "colocated: " in text


def test_an_impossible_target_says_neither_layout_serves_it() -> None:
    result = plan(A100, PlanRequest(**{**TARGET.__dict__, "slo": Slo(ttft_ms=50, tpot_ms=5)}))
    assert result.recommended is None
    assert result.lines[-1].startswith("plan: neither layout meets these SLOs")


@pytest.mark.parametrize(
    "changes",
    [{"slo": Slo(ttft_ms=100)}, {"rate": 0.0}, {"output_len": 1}, {"attainment": 1.0}],
)
def test_a_plan_request_without_both_slos_or_a_rate_is_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PlanRequest(**{**TARGET.__dict__, **changes})  # type: ignore[arg-type]
