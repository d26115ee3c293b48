"""The simulator against the one-H200 run (benchmarks/gpu_run.py), and the xPyD questions one GPU cannot answer.

    .venv/bin/python benchmarks/sim_h200.py side-by-side [--profile llama3-8b-h200] [--measured gpu_run.json]
    .venv/bin/python benchmarks/sim_h200.py xpyd [--profile llama3-8b-h200] [--rates 10,20,30]

side-by-side: the GPU run's load workload (closed loop: 16 streams, 32 requests of 2,000 fresh random
tokens, 128 out) on simulated engines with the profile, one instance alone and 1P1D, next to what was
measured through pdserve on the H200 (the ``load`` step of gpu_run.json). TTFT and ITL medians, the ratio
sim/measured, PASS within 20 %. The sim gives each instance a GPU of its own; on the H200 prefill and
decode shared one, so the 1P1D row is expected to differ where the two contend.

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
from pathlib import Path
from typing import Any

from pdserve.bench.simcluster import _Pulls, run
from pdserve.bench.workload import Slo
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile, load_profile
from pdserve.sim.types import RemoteKV, SimRequest

TOLERANCE = 0.2
# The load step of the 2026-12-03 run (BENCHMARKS.md "GPU (one H200)"), used without --measured.
MEASURED = {
    "one-instance": {"ttft_median_ms": 460.63, "itl_median_ms": 26.75},
    "disaggregated": {"ttft_median_ms": 551.77, "itl_median_ms": 16.60},
}


async def closed_loop(
    profile: Profile, num_prefill: int, requests: int, concurrency: int, prompt: int, output: int, seed: int
) -> dict[str, float]:
    """``requests`` requests, ``concurrency`` at a time, on 1 engine (num_prefill 0) or 1P1D; medians in ms."""
    clock = VirtualClock()
    pulls = _Pulls()

    def engine(role: Any, name: str) -> SimEngine:
        e = SimEngine(profile, role, name, kv_source=pulls, clock=clock)
        pulls.holders[name] = e
        return e

    prefills = [engine("prefill", f"p{i}") for i in range(num_prefill)]
    decode = engine("both" if not prefills else "decode", "d0")
    for e in (*prefills, decode):
        await e.start()
    rng = random.Random(seed)
    ttfts: list[float] = []
    itls: list[float] = []
    cycle = itertools.cycle(prefills or [None])
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            ids = tuple(rng.randrange(100, 1_000_000) for _ in range(prompt))
            start = clock.now()
            remote = None
            prefill = next(cycle)
            if prefill is not None:
                held = None
                async for event in prefill.generate(SimRequest(f"p{i}", ids, 1, hold_for_remote=True)):
                    held = event.held
                assert held is not None
                remote = RemoteKV(prefill.engine_id, f"p{i}", held.block_ids, held.num_tokens, "sim", 0)
            times = []
            async for _event in decode.generate(SimRequest(f"r{i}", ids, output, remote=remote)):
                times.append(clock.now())
            ttfts.append(times[0] - start)
            itls.extend(b - a for a, b in itertools.pairwise(times))

    await asyncio.gather(*(one(i) for i in range(requests)))
    for e in (*prefills, decode):
        await e.stop()
    return {"ttft_median_ms": 1e3 * statistics.median(ttfts), "itl_median_ms": 1e3 * statistics.median(itls)}


def side_by_side(a: argparse.Namespace) -> int:
    profile = load_profile(a.profile)
    measured: dict[str, Any] = MEASURED
    workload = {"concurrency": 16, "requests": 32, "prompt_tokens": 2000, "output_tokens": 128}
    if a.measured:
        load = json.loads(Path(a.measured).read_text())["steps"]["load"]
        measured, workload = load["arms"], load["workload"]
    args = (
        workload["requests"],
        workload["concurrency"],
        workload["prompt_tokens"],
        workload["output_tokens"],
    )
    ok = True
    print(f"profile {profile.name}; workload {json.dumps(workload)}")
    print(f"{'arm':<14} {'':>8} {'TTFT p50 ms':>12} {'ITL p50 ms':>11}")
    for arm, num_prefill in (("one-instance", 0), ("disaggregated", 1)):
        sim = asyncio.run(closed_loop(profile, num_prefill, *args, seed=a.seed))
        real = measured.get(arm, {})
        print(f"{arm:<14} {'sim':>8} {sim['ttft_median_ms']:12.1f} {sim['itl_median_ms']:11.2f}")
        if "ttft_median_ms" in real:
            print(f"{'':<14} {'measured':>8} {real['ttft_median_ms']:12.1f} {real['itl_median_ms']:11.2f}")
            engine_itl = real.get("engine", {}).get("decode", {}).get("inter_token_latency_mean_ms")
            if engine_itl is not None:  # gpu_run.py --load-rounds: vLLM's own timer, not the client's gaps
                coalesced = real.get("itl_coalesced_share", 0.0)
                print(f"{'':<14} {'vLLM':>8} {'':>12} {engine_itl:11.2f}  (decode's mean; {coalesced:.0%} of "
                      "the client's gaps were events read together)")  # fmt: skip
            ratios = [sim[k] / real[k] for k in ("ttft_median_ms", "itl_median_ms")]
            verdict = "PASS" if all(abs(r - 1) <= TOLERANCE for r in ratios) else "FAIL"
            ok = ok and (verdict == "PASS" or arm != "one-instance")
            print(f"{'':<14} {'sim/real':>8} {ratios[0]:12.2f} {ratios[1]:11.2f}  {verdict}")
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
            r = run(profile, p, d, rate, a.input_len, a.output_len, a.requests, a.seed)
            name = f"{p}P{d}D" if p else f"{d} coloc"
            print(f"{rate:7.1f} {name:>12} {r.goodput(slo):10.2f} {r.attainment(slo):7.2f} "
                  f"{1e3 * r.quantile('ttft_s', 0.5):9.0f} {1e3 * r.quantile('ttft_s', 0.9):9.0f} "
                  f"{1e3 * r.quantile('tpot_s', 0.5):9.1f}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("side-by-side")
    s.add_argument("--measured", help="gpu_run.json of an H200 run (default: the 2026-12-03 figures)")
    x = sub.add_parser("xpyd")
    x.add_argument("--rates", default="4,8,12,16")
    x.add_argument("--input-len", type=int, default=2000)
    x.add_argument("--output-len", type=int, default=128)
    x.add_argument("--requests", type=int, default=400)
    x.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    x.add_argument("--slo-tpot-ms", type=float, default=50.0)
    x.add_argument("--ratios", action="store_true", help="also every other P:D split of 8 instances")
    for q in (s, x):
        q.add_argument("--profile", default="llama3-8b-h200")
        q.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    return side_by_side(a) if a.what == "side-by-side" else xpyd(a)


if __name__ == "__main__":
    sys.exit(main())
