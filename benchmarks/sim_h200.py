"""The simulator against the H200 runs (benchmarks/gpu_run.py), and the xPyD questions two GPUs cannot answer.

    .venv/bin/python benchmarks/sim_h200.py side-by-side [--measured two-gpus|one-gpu|FILE] [--fit-prefill]
    .venv/bin/python benchmarks/sim_h200.py xpyd [--profile llama3-8b-h200] [--rates 60,90,120] [--ratios]

side-by-side: the GPU run's load workload (closed loop: 16 streams, 32 requests of 2,000 fresh random
tokens, 128 out) on simulated engines with the profile, arm by arm as gpu_run.py measured them through
pdserve: one instance alone, a colocated pair (both serving whole requests, round robin) and 1P1D. PASS
when TTFT mean and ITL mean are within 20 % of vLLM's own timers (1P1D's TTFT: prefill's then decode's)
and ITL p50 of the client's. TTFT p50 and ITL p90 are printed beside, with the measured rounds' spread,
but do not decide: 16 requests sent at once are prefilled four to a step, so their TTFTs climb in stairs
and the median of 32 lands on whichever stair holds the 16th (one-GPU 1P1D: 483, 609 and 619 ms in three
rounds of one run). Where the measured pair shared one GPU (the run's facts or its name say so, or
--one-gpu) the pair's engines share one simulated GPU (sim/device.py). --fit-prefill first fits
prefill_per_token_s to the one-instance TTFT p50 (steady there: 456-466 ms), which is how the shipped
profile's value was found; the other arms are then the check. benchmarks/sim_one_gpu.py asks what the
shared GPU means for splitting one GPU's two instances.

xpyd: 4P4D against 8 colocated instances, and every P:D split of 8, under Poisson load with fixed lengths
(the simulator's virtual clock: bench/simcluster.py). Goodput is requests/s meeting both SLOs. SIMULATED:
no such cluster was measured.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import add_numbers, script_parser
from pdserve.bench.load import percentile
from pdserve.bench.simcluster import ClusterLoad, _Pulls, run, serve
from pdserve.sim.device import TURN_S, SharedDevice
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile, load_profile
from pdserve.slo import Slo

TOLERANCE = 0.2
DATA = Path(__file__).resolve().parent / "data"
# The load steps of the 2026-12-04 runs (BENCHMARKS.md "CUDA graphs on one and two H200s"): vLLM with CUDA graphs, the pair
# on two H200s (the default) and on one; and the eager run of that morning (steps CPU-bound and drifting by
# a quarter between rounds: the shipped profile, made with CUDA graphs, is not meant to match it).
MEASURED = {
    "two-gpus": DATA / "h200-2026-12-04-two-gpus.json",
    "one-gpu": DATA / "h200-2026-12-04-one-gpu.json",
    "one-gpu-eager": DATA / "h200-2026-12-04-one-gpu-eager.json",
}
# Arm of gpu_run.py's load step -> engines: prefills, decodes ("both" when there is no prefill)
LAYOUTS = {"one-instance": (0, 1), "colocated": (0, 2), "disaggregated": (1, 1)}


async def closed_loop(
    profile: Profile,
    arm: str,
    requests: int,
    concurrency: int,
    prompt: int,
    output: int,
    seed: int,
    one_gpu: bool = False,
    turn_s: float = TURN_S,
) -> dict[str, float]:
    """``requests`` requests, ``concurrency`` at a time, on the arm's engines (round robin where there are
    two of a kind, as pdserve's proxy routes); medians in ms. ``one_gpu``: the engines share one GPU, in
    turns of ``turn_s``."""
    clock = VirtualClock()
    pulls = _Pulls()
    device = SharedDevice(clock, turn_s) if one_gpu else None
    num_prefill, num_decode = LAYOUTS[arm]

    def engine(role: Any, name: str) -> SimEngine:
        e = SimEngine(profile, role, name, kv_source=pulls, clock=clock, device=device)
        pulls.holders[name] = e
        return e

    prefills = [engine("prefill", f"p{i}") for i in range(num_prefill)]
    decodes = [engine("decode" if prefills else "both", f"d{i}") for i in range(num_decode)]
    for e in (*prefills, *decodes):
        await e.start()
    rng = random.Random(seed)
    ttfts: list[float] = []
    itls: list[float] = []
    next_prefill, next_decode = itertools.cycle(prefills or [None]), itertools.cycle(decodes)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            ids = tuple(rng.randrange(100, 1_000_000) for _ in range(prompt))
            start = clock.now()
            times = await serve(i, ids, output, next(next_prefill), next(next_decode), clock)
            ttfts.append(times[0] - start)
            itls.extend(b - a for a, b in itertools.pairwise(times))

    await asyncio.gather(*(one(i) for i in range(requests)))
    for e in (*prefills, *decodes):
        await e.stop()
    return {
        "ttft_median_ms": 1e3 * statistics.median(ttfts),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
        "itl_median_ms": 1e3 * statistics.median(itls),
        "itl_p90_ms": 1e3 * percentile(itls, 0.9),
        "itl_mean_ms": 1e3 * statistics.fmean(itls),
        "duration_s": clock.now(),
    }


def load_measured(name_or_path: str) -> tuple[dict[str, Any], dict[str, Any], bool, list[dict[str, Any]]]:
    """(arms, workload, whether the pair shared one GPU, the rounds each arm ran) of a gpu_run.json."""
    record = json.loads(Path(MEASURED.get(name_or_path, name_or_path)).read_text())
    load = record["steps"]["load"]
    plan = record["steps"].get("facts", {}).get("default_plan")
    # Those runs had no facts step: their names say where the pair ran.
    one_gpu = name_or_path.startswith("one-gpu") or (bool(plan) and len({i["env"] for i in plan}) == 1)
    return load["arms"], load["workload"], one_gpu, load.get("rounds", [])


def spread(rounds: list[dict[str, Any]], arm: str) -> str:
    """The arm's TTFT p50 in each measured round, where there were several: how far it moves by itself."""
    p50s = [r[arm]["ttft_median_ms"] for r in rounds if "ttft_median_ms" in r.get(arm, {})]
    return f"  (rounds {min(p50s):.0f}-{max(p50s):.0f})" if len(p50s) > 1 else ""


def vllm_ttft_mean(arm: str, real: dict[str, Any]) -> float:
    """The arm's mean TTFT by vLLM's own timers: prefill's then decode's for 1P1D (the proxy's hand-off
    between them is a millisecond), the two instances' mean for the colocated pair (round robin)."""
    engine = real.get("engine", {})
    means = [engine.get(role, {}).get("time_to_first_token_mean_ms") for role in ("prefill", "decode")]
    known = [m for m in means if m is not None]
    if not known:
        return float("nan")
    return sum(known) if arm == "disaggregated" else statistics.fmean(known)


def fit_prefill(profile: Profile, real: dict[str, Any], args: tuple[int, int, int, int], seed: int) -> float:
    """prefill_per_token_s at which the sim's one-instance TTFT p50 equals the measured one (bisection)."""
    low, high = 0.0, 1e-3
    for _ in range(30):
        mid = (low + high) / 2
        sim = asyncio.run(
            closed_loop(replace(profile, prefill_per_token_s=mid), "one-instance", *args, seed=seed)
        )
        low, high = (mid, high) if sim["ttft_median_ms"] < real["ttft_median_ms"] else (low, mid)
    return (low + high) / 2


def side_by_side(a: argparse.Namespace) -> int:
    profile = load_profile(a.profile)
    measured, workload, one_gpu, rounds = load_measured(a.measured)
    one_gpu = a.one_gpu or one_gpu
    args = (
        workload["requests"],
        workload["concurrency"],
        workload["prompt_tokens"],
        workload["output_tokens"],
    )
    if a.fit_prefill:
        fitted = fit_prefill(profile, measured["one-instance"], args, a.seed)
        print(f"prefill_per_token_s fitted to the one-instance TTFT p50: {fitted:.4g} (profile: "
              f"{profile.prefill_per_token_s:.4g}); the rows below use it")  # fmt: skip
        profile = replace(profile, prefill_per_token_s=fitted)
    ok = True
    print(f"profile {profile.name}; measured {a.measured} ({'the pair on one GPU' if one_gpu else 'one GPU each'}); "
          f"workload {json.dumps(workload)}")  # fmt: skip
    print(
        f"{'arm':<14} {'':>8} {'TTFT mean ms':>13} {'ITL p50 ms':>11} {'ITL mean ms':>12} {'TTFT p50 ms':>12} "
        f"{'ITL p90 ms':>11}"
    )
    for arm in LAYOUTS:
        real = measured.get(arm, {})
        if "ttft_median_ms" not in real:
            continue
        sim = asyncio.run(
            closed_loop(profile, arm, *args, seed=a.seed, one_gpu=one_gpu)  # one engine alone: the same
        )
        # vLLM's own timers (the engines' means, not the client's reads) for TTFT mean and ITL mean
        engine_itl = real.get("engine", {}).get("decode", {}).get("inter_token_latency_mean_ms", float("nan"))
        engine_ttft = vllm_ttft_mean(arm, real)
        print(f"{arm:<14} {'sim':>8} {sim['ttft_mean_ms']:13.1f} {sim['itl_median_ms']:11.2f} "
              f"{sim['itl_mean_ms']:12.2f} {sim['ttft_median_ms']:12.1f} "
              f"{sim['itl_p90_ms']:11.2f}")  # fmt: skip
        print(f"{'':<14} {'measured':>8} {engine_ttft:13.1f} {real['itl_median_ms']:11.2f} "
              f"{engine_itl:12.2f} {real['ttft_median_ms']:12.1f} "
              f"{real.get('itl_p90_ms', float('nan')):11.2f}{spread(rounds, arm)}")  # fmt: skip
        ratios = [sim["ttft_mean_ms"] / engine_ttft, sim["itl_median_ms"] / real["itl_median_ms"],
                  sim["itl_mean_ms"] / engine_itl]  # fmt: skip
        verdict = "PASS" if all(abs(r - 1) <= TOLERANCE for r in ratios if r == r) else "FAIL"
        ok = ok and verdict == "PASS"
        print(f"{'':<14} {'sim/real':>8} {ratios[0]:13.2f} {ratios[1]:11.2f} {ratios[2]:12.2f} "
              f"{sim['ttft_median_ms'] / real['ttft_median_ms']:12.2f} "
              f"{sim['itl_p90_ms'] / real.get('itl_p90_ms', float('nan')):11.2f}  {verdict}")  # fmt: skip
    return 0 if ok else 1


def xpyd(a: argparse.Namespace) -> int:
    profile = load_profile(a.profile)
    slo = Slo(ttft_ms=a.slo_ttft_ms, tpot_ms=a.slo_tpot_ms)
    rates = [float(r) for r in a.rates.split(",")]
    print(f"SIMULATED with profile {profile.name}: {a.input_len} tokens in, {a.output_len} out, Poisson, "
          f"{a.requests} requests per point; SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms")  # fmt: skip
    print(
        f"{'rate/s':>7} {'config':>12} {'goodput/s':>10} {'attain':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9}"
    )
    splits = [(4, 4), (0, 8)] + ([(p, 8 - p) for p in range(1, 8) if p != 4] if a.ratios else [])
    for rate in rates:
        for p, d in splits:
            r = run(profile, ClusterLoad(p, d, rate, a.input_len, a.output_len, a.requests, a.seed))
            name = f"{p}P{d}D" if p else f"{d} coloc"
            print(f"{rate:7.1f} {name:>12} {r.goodput(slo):10.2f} {r.attainment(slo):7.2f} "
                  f"{1e3 * r.quantile('ttft_s', 0.5):9.0f} {1e3 * r.quantile('ttft_s', 0.9):9.0f} "
                  f"{1e3 * r.quantile('tpot_s', 0.5):9.1f}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("side-by-side")
    s.add_argument(
        "--measured",
        default="two-gpus",
        help=f"gpu_run.json of an H200 run, or one of {', '.join(MEASURED)} (benchmarks/data/)",
    )
    s.add_argument(
        "--one-gpu",
        action="store_true",
        help="the measured pair shared one GPU (read from the run's facts step when it has one)",
    )
    s.add_argument(
        "--fit-prefill",
        action="store_true",
        help="fit prefill_per_token_s to the measured one-instance TTFT first",
    )
    x = sub.add_parser("xpyd")
    x.add_argument("--rates", default="4,8,12,16")
    add_numbers(x, {"--input-len": 2000, "--output-len": 128, "--requests": 400})
    add_numbers(x, {"--slo-ttft-ms": 1000.0, "--slo-tpot-ms": 50.0})
    x.add_argument("--ratios", action="store_true", help="also every other P:D split of 8 instances")
    for q in (s, x):
        q.add_argument("--profile", default="llama3-8b-h200")
        q.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    return side_by_side(a) if a.what == "side-by-side" else xpyd(a)


if __name__ == "__main__":
    sys.exit(main())
