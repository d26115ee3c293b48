"""One H200 shared by two instances: 1P1D against the same two colocated, on the simulator's shared GPU.

    .venv/bin/python benchmarks/sim_one_gpu.py [--profile llama3-8b-h200] [--turns-ms 2.4,8,0.5]
        [--rates 2,4,6,8] [--requests 400] [--slos 1000:10,1000:15,1000:50]

Both engines of each arm run on one simulated GPU (sim/device.py: turns of ``--turns-ms``, first come
first served): the fitted 2.4 ms, the 8 ms of the earlier model, and 0.5 ms, which is close to an even
share of the GPU (processor sharing). Two workloads, 2,000 fresh random tokens in and 128 out:

  gpu_share  benchmarks/gpu_share.py's synced phase replayed: 5 ms decode steps 0.37 ms apart beside 178 ms
             prefill steps 2 ms apart (measured on the H200: 12.18 and 312 ms)
  load step  gpu_run.py's closed loop (16 streams, 32 requests), printed beside the H200's one-GPU run
  Poisson    open loop at each of ``--rates`` (bench/simcluster.py's workload), goodput (requests/s
             meeting both) per SLO given as TTFT ms:TPOT ms

SIMULATED: only the load step was measured on one GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import statistics
import sys
from typing import Any

from _common import add_numbers, script_parser
from pdserve.bench.simcluster import ClusterLoad, ClusterRun, Timing, _Pulls, serve
from pdserve.sim.device import SharedDevice
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile, load_profile
from pdserve.slo import Slo
from sim_h200 import LAYOUTS, closed_loop, load_measured, vllm_ttft_mean

ARMS = {"1P1D": "disaggregated", "colocated": "colocated"}  # name here -> sim_h200's arm


async def simulate(profile: Profile, load: ClusterLoad, turn_s: float) -> ClusterRun:
    """bench/simcluster.py's ``simulate`` with every engine on one SharedDevice."""
    clock = VirtualClock()
    pulls = _Pulls()
    device = SharedDevice(clock, turn_s)

    def engine(role: Any, name: str) -> SimEngine:
        e = SimEngine(profile, role, name, kv_source=pulls, clock=clock, device=device)
        pulls.holders[name] = e
        return e

    colocated = load.num_prefill == 0
    prefills = [engine("prefill", f"p{i}") for i in range(load.num_prefill)]
    decodes = [engine("both" if colocated else "decode", f"d{i}") for i in range(load.num_decode)]
    for e in (*prefills, *decodes):
        await e.start()
    rng = random.Random(load.seed)
    next_prefill, next_decode = itertools.cycle(prefills or [None]), itertools.cycle(decodes)
    timings: list[Timing] = []

    async def one(i: int, prompt: tuple[int, ...], prefill: SimEngine | None, decode: SimEngine) -> None:
        start = clock.now()
        times = await serve(i, prompt, load.output_len, prefill, decode, clock)
        first, last = (times[0], times[-1]) if times else (math.nan, math.nan)
        tpot = (last - first) / (load.output_len - 1) if load.output_len > 1 else 0.0
        timings.append(Timing(first - start, tpot, last - start))

    began = clock.now()
    tasks = []
    for i in range(load.num_requests):
        await clock.sleep(rng.expovariate(load.rate))
        prompt = tuple(rng.randrange(100, 1_000_000) for _ in range(load.input_len))
        tasks.append(asyncio.ensure_future(one(i, prompt, next(next_prefill), next(next_decode))))
    await asyncio.gather(*tasks)
    duration = clock.now() - began
    for e in (*prefills, *decodes):
        await e.stop()
    return ClusterRun(load, tuple(timings), duration)


async def gpu_share(turn_s: float, seconds: float = 3.0) -> tuple[float, float]:
    """The median decode step and prefill step (s) of gpu_share.py's "both, decode synced" phase."""
    clock = VirtualClock()
    device = SharedDevice(clock, turn_s)
    steps: dict[float, list[float]] = {0.005: [], 0.178: []}

    async def loop(work: float, gap: float) -> None:
        while clock.now() < seconds:
            start = clock.now()
            await device.run(work)
            steps[work].append(clock.now() - start)
            await clock.sleep(gap)

    await asyncio.gather(loop(0.005, 0.00037), loop(0.178, 0.002))
    return statistics.median(steps[0.005]), statistics.median(steps[0.178])


def load_step(profile: Profile, turns: list[float], seed: int) -> None:
    measured, workload, _, _ = load_measured("one-gpu")
    args = (
        workload["requests"],
        workload["concurrency"],
        workload["prompt_tokens"],
        workload["output_tokens"],
    )
    print(f"load step: {describe(workload)}; ms, the run in s")
    print(f"{'turn':>9} {'arm':>10} {'TTFT mean':>10} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p90':>8} "
          f"{'ITL mean':>9} {'run s':>6}")  # fmt: skip
    for name, arm in ARMS.items():
        real = measured[arm]
        itl_mean = real["engine"]["decode"]["inter_token_latency_mean_ms"]
        print(f"{'H200':>9} {name:>10} {vllm_ttft_mean(arm, real):10.0f} {real['ttft_median_ms']:9.0f} "
              f"{real['itl_median_ms']:8.2f} {real['itl_p90_ms']:8.2f} {itl_mean:9.2f} "
              f"{real['duration_s']:6.2f}")  # fmt: skip
    for turn in turns:
        decode, prefill = asyncio.run(gpu_share(turn))
        print(
            f"{1e3 * turn:7.1f}ms  gpu_share: decode step {1e3 * decode:.2f} ms, prefill step {1e3 * prefill:.0f}"
        )
        for name, arm in ARMS.items():
            assert arm in LAYOUTS
            r = asyncio.run(closed_loop(profile, arm, *args, seed=seed, one_gpu=True, turn_s=turn))
            print(f"{1e3 * turn:7.1f}ms {name:>10} {r['ttft_mean_ms']:10.0f} {r['ttft_median_ms']:9.0f} "
                  f"{r['itl_median_ms']:8.2f} {r['itl_p90_ms']:8.2f} {r['itl_mean_ms']:9.2f} "
                  f"{r['duration_s']:6.2f}")  # fmt: skip


def describe(workload: dict[str, Any]) -> str:
    return (
        f"{workload['concurrency']} streams, {workload['requests']} requests of "
        f"{workload['prompt_tokens']} tokens, {workload['output_tokens']} out"
    )


def poisson(profile: Profile, turns: list[float], a: argparse.Namespace) -> None:
    slos = [Slo(ttft_ms=float(t), tpot_ms=float(p)) for t, p in (s.split(":") for s in a.slos.split(","))]
    heads = " ".join(f"{f'good {s.ttft_ms:g}:{s.tpot_ms:g}':>13}" for s in slos)
    print(
        f"Poisson, {a.requests} requests a point, {a.input_len} tokens in, {a.output_len} out; goodput req/s"
    )
    print(f"{'turn':>9} {'rate/s':>6} {'arm':>10} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} "
          f"{'TPOT p90':>9} {heads}")  # fmt: skip
    for turn in turns:
        for rate in (float(r) for r in a.rates.split(",")):
            for name, (p, d) in {"1P1D": (1, 1), "colocated": (0, 2)}.items():
                load = ClusterLoad(p, d, rate, a.input_len, a.output_len, a.requests, a.seed)
                r = asyncio.run(simulate(profile, load, turn))
                good = " ".join(f"{r.goodput(s):13.2f}" for s in slos)
                print(f"{1e3 * turn:7.1f}ms {rate:6.1f} {name:>10} {1e3 * r.quantile('ttft_s', 0.5):9.0f} "
                      f"{1e3 * r.quantile('ttft_s', 0.9):9.0f} {1e3 * r.quantile('tpot_s', 0.5):9.1f} "
                      f"{1e3 * r.quantile('tpot_s', 0.9):9.1f} {good}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--profile", default="llama3-8b-h200")
    p.add_argument("--turns-ms", default="2.4,8,0.5")
    p.add_argument("--rates", default="2,4,6,8")
    p.add_argument("--slos", default="1000:10,1000:15,1000:50")
    add_numbers(p, {"--input-len": 2000, "--output-len": 128, "--requests": 400})
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-poisson", action="store_true")
    a = p.parse_args(argv)
    profile = load_profile(a.profile)
    turns = [float(t) / 1e3 for t in a.turns_ms.split(",")]
    print(f"SIMULATED with profile {profile.name}: two instances on one shared GPU")
    load_step(profile, turns, a.seed)
    if not a.skip_poisson:
        poisson(profile, turns, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
