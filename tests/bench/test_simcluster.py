"""The simulated cluster `pdserve plan --check` measures with: the simulator's engines on a virtual clock,
split (prefill → pull → decode) or colocated, under Poisson load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.bench import simcluster
from pdserve.bench.command import _sim_profile_with_link
from pdserve.bench.trace import Burst, Phase, Trace
from pdserve.configparts import ElasticPool
from pdserve.errors import ConfigError
from pdserve.sim.profile import load_profile
from pdserve.slo import Slo
from pdserve.topology import Topology

A100 = load_profile("llama3-8b-a100")


def test_every_request_is_served_in_both_layouts_and_a_seed_repeats_a_run() -> None:
    split = simcluster.run(A100, simcluster.ClusterLoad(1, 1, 2.0, 512, 16, num_requests=40))
    whole = simcluster.run(A100, simcluster.ClusterLoad(0, 2, 2.0, 512, 16, num_requests=40))
    assert len(split.timings) == len(whole.timings) == 40
    assert (split.num_instances, whole.num_instances) == (2, 2)
    assert split == simcluster.run(A100, simcluster.ClusterLoad(1, 1, 2.0, 512, 16, num_requests=40))
    assert split != simcluster.run(A100, simcluster.ClusterLoad(1, 1, 2.0, 512, 16, num_requests=40, seed=1))


def test_the_split_pays_the_kv_transfer_in_ttft_and_a_slow_link_pays_more() -> None:
    # 2,048 tokens of Llama-3-8B KV are 268 MB: ~14 ms at the profile's 20 GB/s, ~540 ms at 0.5 GB/s.
    fast = simcluster.run(A100, simcluster.ClusterLoad(1, 1, 0.5, 2048, 8, num_requests=20))
    slow = simcluster.run(
        A100.with_kv_bandwidth(0.5e9), simcluster.ClusterLoad(1, 1, 0.5, 2048, 8, num_requests=20)
    )
    whole = simcluster.run(A100, simcluster.ClusterLoad(0, 1, 0.5, 2048, 8, num_requests=20))
    median = 0.5
    assert fast.quantile("ttft_s", median) > whole.quantile("ttft_s", median)
    assert slow.quantile("ttft_s", median) - fast.quantile("ttft_s", median) == pytest.approx(0.52, abs=0.05)


def test_colocated_decodes_stall_behind_prefills_and_split_ones_do_not() -> None:
    # A 4,096-token prompt is a 290 ms prefill: every decode sharing that step waits for it.
    split = simcluster.run(A100, simcluster.ClusterLoad(1, 1, 5.0, 4096, 64, num_requests=60))
    whole = simcluster.run(A100, simcluster.ClusterLoad(0, 2, 5.0, 4096, 64, num_requests=60))
    assert whole.quantile("tpot_s", 0.9) > 2 * split.quantile("tpot_s", 0.9)


def test_goodput_counts_only_requests_that_met_every_slo_per_second() -> None:
    run = simcluster.run(A100, simcluster.ClusterLoad(1, 1, 2.0, 512, 16, num_requests=40))
    assert run.goodput(Slo()) == pytest.approx(40 / run.duration_s)
    assert run.attainment(Slo(ttft_ms=0.001)) == 0.0 and run.goodput(Slo(ttft_ms=0.001)) == 0.0
    ttfts_ms = sorted(t.ttft_s * 1000 for t in run.timings)
    assert run.attainment(Slo(ttft_ms=ttfts_ms[-1])) == 1.0
    assert run.attainment(Slo(ttft_ms=ttfts_ms[-1], tpot_ms=0.001)) == 0.0  # every SLO must be met
    assert 0 < run.attainment(Slo(ttft_ms=ttfts_ms[len(ttfts_ms) // 2])) < 1
    assert run.goodput_per_instance(Slo()) == pytest.approx(run.goodput(Slo()) / 2)


def test_the_link_knob_sets_the_pull_cost_per_block_from_a_bandwidth() -> None:
    slow = A100.with_kv_bandwidth(0.5e9)
    assert slow.kv_bandwidth_bytes_per_s == pytest.approx(0.5e9)
    # 256 blocks of 2 MiB (4,096 tokens) at 0.5 GB/s, plus the profile's fixed cost per pull.
    assert slow.pull_seconds(256) == pytest.approx(A100.kv_pull_base_s + 256 * 2**21 / 0.5e9)
    assert (slow.step_base_s, slow.num_blocks) == (A100.step_base_s, A100.num_blocks)
    assert load_profile("zero").kv_bandwidth_bytes_per_s == float("inf")
    with pytest.raises(ConfigError, match="bandwidth must be > 0"):
        A100.with_kv_bandwidth(0)


def test_bench_writes_the_slow_link_profile_where_the_sim_instances_read_it(tmp_path: Path) -> None:
    topology = _sim_profile_with_link(Topology(engine="sim", sim_profile="llama3-8b-a100"), 0.5, tmp_path)
    written = load_profile(topology.sim_profile)
    assert written.name == "llama3-8b-a100-0.5gbps"
    assert written.kv_bandwidth_bytes_per_s == pytest.approx(0.5e9)
    assert written == dataclasses.replace(A100.with_kv_bandwidth(0.5e9), name=written.name)


def test_a_cluster_without_decode_or_load_is_refused_when_it_is_described() -> None:
    for bad in ((1, 0, 2.0, 512, 16), (-1, 1, 2.0, 512, 16), (1, 1, 0.0, 512, 16), (1, 1, 2.0, 0, 16)):
        with pytest.raises(ConfigError):
            simcluster.ClusterLoad(*bad)


H200 = load_profile("llama3-8b-h200")
SHORT = Trace(
    (
        Phase(2.0, 40, 2000, 16),
        Phase(3.0, 10, 100, 64, bursts=Burst(period_s=1.5, duration_s=0.5, rate=60)),
    )
)


def test_a_trace_draws_poisson_arrivals_phase_by_phase_with_its_bursts() -> None:
    assert SHORT.phases[1].stretches() == [(0.0, 1.0, 10), (1.0, 1.5, 60), (1.5, 2.5, 10), (2.5, 3.0, 60)]
    arrivals = SHORT.arrivals(seed=3)
    assert arrivals == SHORT.arrivals(seed=3) != SHORT.arrivals(seed=4)
    assert [a.index for a in arrivals] == list(range(len(arrivals)))
    assert all(a.at < 2.0 for a in arrivals if a.phase == 0) and all(
        a.at >= 2.0 for a in arrivals if a.phase == 1
    )
    long = Trace((Phase(100.0, 20, 10, 2, Burst(10.0, 5.0, 60)),))
    in_bursts = sum(1 for a in long.arrivals() if a.at % 10 >= 5)
    assert in_bursts == pytest.approx(60 * 50, rel=0.1) and len(long.arrivals()) == pytest.approx(
        80 * 50, rel=0.1
    )
    with pytest.raises(ConfigError):
        Burst(period_s=1.0, duration_s=2.0, rate=10)


def test_the_elastic_arm_drives_the_router_and_reports_goodput_per_phase() -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=10)
    pool = ElasticPool(costs=H200.costs(), slo=slo)
    elastic = simcluster.run_trace(H200, SHORT, simcluster.Elastic(4, pool))
    whole = simcluster.run_trace(H200, SHORT, simcluster.Fixed(0, 4))
    split = simcluster.run_trace(H200, SHORT, simcluster.Fixed(2, 2))
    arrivals = SHORT.arrivals()
    for run in (elastic, whole, split):
        assert len(run.served) == len(arrivals)
        assert [sum(1 for s in run.served if s.phase == k) for k in (0, 1)] == [
            sum(1 for a in arrivals if a.phase == k) for k in (0, 1)
        ]
        per_phase = [run.goodput(slo, k) for k in (0, 1)]
        assert run.goodput(slo) == pytest.approx(
            sum(g * p.duration_s for g, p in zip(per_phase, SHORT.phases, strict=True)) / 5.0
        )
        assert run.cpu_s > 0
    assert split.split_share() == 1.0 and whole.split_share() == 0.0
    # Long prompts are split by the router; prompts cheaper than a decode step are served whole.
    assert elastic.split_share(0) > 0.8 and elastic.split_share(1) < 0.2
    assert elastic.goodput(slo, 0) >= 0.95 * max(whole.goodput(slo, 0), split.goodput(slo, 0))
    assert elastic.quantile("ttft_s", 0.5, phase=0) > 0 and elastic.quantile("tpot_s", 0.9) > 0


def test_a_pinned_elastic_arm_keeps_its_layout_and_says_so() -> None:
    pool = ElasticPool(costs=H200.costs(), slo=Slo(ttft_ms=1000, tpot_ms=10), num_prefill=0)
    held = simcluster.run_trace(H200, SHORT, simcluster.Elastic(4, pool))
    assert held.arm == "coloc+hold" and held.split_share() == 0.0  # the long prompts too stay whole
    pinned = simcluster.Elastic(4, dataclasses.replace(pool, num_prefill=1))
    assert pinned.describe() == "1P3D+hold"
