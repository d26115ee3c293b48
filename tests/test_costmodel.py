"""The cost model the planner and the elastic pool's router share: it ranks the layouts of N instances
for a load as `pdserve plan` and the simulator find them."""

from __future__ import annotations

import pytest

from pdserve.bench.plan import PlanRequest, plan
from pdserve.costmodel import Calibration, Costs, Load, Model, rank_layouts
from pdserve.errors import ConfigError
from pdserve.sim.profile import load_profile
from pdserve.slo import Slo

A100 = load_profile("llama3-8b-a100").costs()
H200 = load_profile("llama3-8b-h200").costs()
TIGHT = Slo(ttft_ms=1000, tpot_ms=10)
LOOSE = Slo(ttft_ms=300, tpot_ms=20)


def best(costs: Costs, n: int, load: Load, slo: Slo | None) -> str:
    return rank_layouts(costs, n, load, slo)[0].describe()


def test_the_ranking_agrees_with_the_plan_on_its_known_answer() -> None:
    # tests/bench/test_bench_plan.py: 5 req/s of 4,096 in / 64 out under TTFT 1 s, TPOT 20 ms on A100
    # shapes is 2P1D, proven on the simulator; over 0.5 GB/s the plan colocates.
    slo = Slo(ttft_ms=1000, tpot_ms=20)
    load = Load(5.0, 4096, 64)
    known = plan(
        load_profile("llama3-8b-a100"), PlanRequest(rate=5.0, input_len=4096, output_len=64, slo=slo)
    )
    assert known.recommended is not None
    assert (known.recommended.num_prefill, known.recommended.num_decode) == (2, 1)
    ranked = rank_layouts(A100, 3, load, slo)
    assert ranked[0].describe() == "2P1D" and ranked[0].meets_slo
    assert ranked[0].capacity == pytest.approx(Model(A100, load, slo).capacity(2, 1))
    assert best(A100.with_kv_bandwidth(0.5e9), 3, load, slo) == "3 colocated"


def test_prefill_heavy_traffic_splits_and_decode_heavy_traffic_colocates() -> None:
    assert rank_layouts(H200, 8, Load(90, 2000, 128), TIGHT)[0].is_split
    assert rank_layouts(H200, 8, Load(30, 2000, 128), TIGHT)[0].is_split
    assert best(H200, 8, Load(40, 300, 1000), TIGHT) == "8 colocated"
    assert best(H200, 8, Load(40, 300, 1000), LOOSE) == "8 colocated"
    # 2,000 tokens of KV (262 MB) take 0.52 s over 0.5 GB/s: no split meets a 300 ms TTFT.
    assert best(H200.with_kv_bandwidth(0.5e9), 8, Load(30, 2000, 128), LOOSE) == "8 colocated"


def test_among_layouts_that_meet_the_slo_the_most_headroom_in_rate_comes_first() -> None:
    # 2P6D has the most latency slack at 30 req/s of 2,000-token prompts but serves 36 at most; the
    # first must serve the next phase's 90 req/s without a queue building first.
    ranked = rank_layouts(H200, 8, Load(30, 2000, 128), TIGHT)
    meeting = [lay for lay in ranked if lay.meets_slo]
    assert ranked[: len(meeting)] == meeting and len(meeting) >= 4
    capacities = [lay.capacity for lay in meeting]
    assert capacities == sorted(capacities, reverse=True)  # type: ignore[type-var]
    assert ranked[0].capacity is not None and ranked[0].capacity > 90
    two_six = next(lay for lay in ranked if lay.describe() == "2P6D")
    assert two_six.slack > ranked[0].slack and two_six.capacity is not None and two_six.capacity < 40


def test_overloaded_layouts_rank_by_capacity_and_without_an_slo_by_latency() -> None:
    ranked = rank_layouts(H200, 8, Load(400, 2000, 128), TIGHT)
    assert not any(lay.meets_slo for lay in ranked)
    capacities = [lay.capacity or 0.0 for lay in ranked]
    assert capacities == sorted(capacities, reverse=True)
    plain = rank_layouts(H200, 8, Load(40, 300, 1000), None)
    assert all(lay.capacity is None for lay in plain)
    assert [lay.slack for lay in plain] == sorted((lay.slack for lay in plain), reverse=True)


def test_a_load_and_an_slo_are_checked_when_they_are_made() -> None:
    for bad in ((0, 100, 10), (1, 0, 10), (1, 100, 1)):
        with pytest.raises(ConfigError):
            Load(*bad)
    with pytest.raises(ConfigError):
        Slo(ttft_ms=0)
    assert Slo.parse(["ttft:300", "tpot:20"]) == LOOSE


def test_a_calibration_multiplies_each_kind_of_layout_and_its_capacity_follows() -> None:
    load, slo = Load(5.6, 2000, 128), Slo(ttft_ms=1500, tpot_ms=15)
    plain = {lay.describe(): lay for lay in rank_layouts(H200, 2, load, slo)}
    slow = Calibration(whole_ttft=8.5, whole_tpot=2.7)
    calibrated = rank_layouts(H200, 2, load, slo, slow)
    assert calibrated[0].describe() == "1P1D"  # colocated no longer meets TPOT <= 15 ms
    coloc = next(lay for lay in calibrated if not lay.is_split)
    assert coloc.tpot_s == pytest.approx(plain["2 colocated"].tpot_s * 2.7)
    assert not coloc.meets_slo and coloc.capacity is not None
    assert coloc.capacity < plain["2 colocated"].capacity  # type: ignore[operator]
    assert calibrated[0].tpot_s == plain["1P1D"].tpot_s  # split: untouched


def test_a_split_decode_that_computes_short_prompts_itself_takes_fewer_sequences() -> None:
    costs = load_profile("llama3-8b-h200").costs()
    m = Model(costs, Load(40.0, 1000, 200), Slo(ttft_ms=1000, tpot_ms=10))
    assert m.max_batch(True, whole_tokens=0.0) == m.max_batch(True)
    assert m.max_batch(True, whole_tokens=1000.0) == m.max_batch(False)  # all of them: colocated's cap
    assert m.max_batch(False) < m.max_batch(True, whole_tokens=300.0) < m.max_batch(True)


def test_mixed_prompt_lengths_queue_longer_and_stall_colocated_decodes_more() -> None:
    costs = load_profile("llama3-8b-h200").costs()
    same, mixed = Load(30.0, 1500, 200), Load(30.0, 1500, 200, input_cv2=1.5)
    assert Model(costs, mixed).pd_latency(2, 2, 30.0)[0] > Model(costs, same).pd_latency(2, 2, 30.0)[0]
    assert (
        Model(costs, mixed).colocated_latency(4, 30.0)[1] > Model(costs, same).colocated_latency(4, 30.0)[1]
    )


def test_the_most_sequences_an_instance_runs_keep_the_step_quantile_within_the_tpot_objective() -> None:
    m = Model(H200, Load(40.0, 1000, 200), Slo(ttft_ms=1000, tpot_ms=10))
    batch = m.max_batch(True)
    at_mean = (0.010 - H200.step_base_s) / m.per_seq_s  # every stream misses whenever the batch swings up
    assert 80 < batch < at_mean
    quantile_step = H200.step_base_s + m.per_seq_s * (batch + m.z * batch**0.5)
    assert quantile_step == pytest.approx(0.010, rel=1e-6)
