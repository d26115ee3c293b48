"""The elastic pool against every fixed layout of the same instances, on a trace whose traffic moves. SIMULATED.

    .venv/bin/python benchmarks/elastic.py [--profile llama3-8b-h200] [--instances 8] [--phase-s 30]
                                           [--burst-phase-s 40] [--slow-gbps 0.5] [--seed 0]
                                           [--pinned 5,0] [--skip-slow]

One trace (bench/trace.py), replayed on the simulator's engines on a virtual clock (bench/simcluster.py):

  1. --phase-s of 30 req/s, 2,000 tokens in / 128 out (prefill-heavy, light);
  2. --phase-s of 90 req/s of the same (prefill-heavy, heavy);
  3. --phase-s of 40 req/s, 300 in / 1,000 out (decode-heavy);
  4. --burst-phase-s of phase 3's traffic at 40 req/s whose last 20 s are a burst of 120 req/s.

Arms: the elastic pool (N engines that each serve whole requests, hold KV for a remote decode and pull
it; the proxy's own ElasticRouter places every request, on the virtual clock), every fixed xPyD of the
same N and N colocated (round robin, as the proxy's default). The fixed layouts do not depend on the SLO:
each runs once and is scored against both pairs; the router plans against its SLO, so the elastic pool
runs once per pair. --pinned X,... adds, per pair, the same router and hold kept to X prefill-side
instances ("5P3D+hold"; 0 is all colocated): a fixed layout with everything else the pool has, which
tells the gain of moving the layout from the gain of holding. Goodput: requests that met both
objectives per second of their phase (a request counts to the phase it arrived in, however late it
ends; the replay waits for the last one). Then the
same over a link too slow to split (--slow-gbps): the elastic pool against colocated (which moves no KV,
so its run over the fast link is the same run).

Goals (a RESULT line says which hold): elastic within 5 % of the best fixed layout's goodput in every
phase; at least 1.3x the goodput of the best single fixed layout over the whole trace; over the slow link,
within 5 % of colocated, per phase and overall. CPU time per arm is printed: the run is a few minutes.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

from _common import add_numbers, print_result, script_parser
from pdserve.bench.simcluster import Elastic, Fixed, run_trace
from pdserve.bench.trace import Burst, Phase, Trace, TraceRun
from pdserve.configparts import ElasticPool
from pdserve.sim.profile import Profile, load_profile
from pdserve.slo import Slo

SLOS = (Slo(ttft_ms=1000, tpot_ms=10), Slo(ttft_ms=300, tpot_ms=20))
WITHIN = 0.05  # elastic may trail the best fixed layout of a phase by this share
OVER_BEST_SINGLE = 1.3  # and must beat the best single fixed layout over the trace by this factor
BURST_S = 20.0


def the_trace(phase_s: float, burst_phase_s: float) -> Trace:
    burst = Burst(period_s=burst_phase_s, duration_s=min(BURST_S, burst_phase_s), rate=120)
    return Trace(
        (
            Phase(phase_s, 30, 2000, 128),
            Phase(phase_s, 90, 2000, 128),
            Phase(phase_s, 40, 300, 1000),
            Phase(burst_phase_s, 40, 300, 1000, burst),
        )
    )


def replay(profile: Profile, trace: Trace, arm: Fixed | Elastic, seed: int) -> TraceRun:
    r = run_trace(profile, trace, arm, seed)
    print(f"  {r.arm:<10} {r.cpu_s:6.1f} s CPU, {len(r.served)} requests, {100 * r.split_share():.0f} % split",
          file=sys.stderr, flush=True)  # fmt: skip
    return r


def table(title: str, trace: Trace, slo: Slo, runs: list[TraceRun]) -> None:
    print(f"\n{title}: goodput, requests/s meeting {slo.describe()}")
    print(f"{'phase':<64}" + "".join(f"{r.arm:>11}" for r in runs))
    rows = [(f"{k + 1}. {p.describe()}", k) for k, p in enumerate(trace.phases)]
    for label, k in [*rows, ("overall", None)]:
        print(f"{label:<64}" + "".join(f"{r.goodput(slo, k):11.1f}" for r in runs))
    for field, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for q in (0.5, 0.9):
            print(f"{f'{name} p{int(q * 100)} ms (all phases)':<64}"
                  + "".join(f"{1e3 * r.quantile(field, q):11.0f}" for r in runs))  # fmt: skip


def judge(
    trace: Trace, slo: Slo, elastic: TraceRun, fixed: list[TraceRun], held: list[TraceRun]
) -> dict[str, Any]:
    phases = []
    for k in range(len(trace.phases)):
        best = max(fixed, key=lambda r: r.goodput(slo, k))
        got, want = elastic.goodput(slo, k), best.goodput(slo, k)
        phases.append({"phase": k + 1, "elastic": round(got, 2), "best": best.arm,
                       "best_goodput": round(want, 2), "ok": got >= (1 - WITHIN) * want})  # fmt: skip
    single = max(fixed, key=lambda r: r.goodput(slo))
    oracle = sum(max(r.goodput(slo, k) for r in fixed) * p.duration_s for k, p in enumerate(trace.phases))
    ratio = elastic.goodput(slo) / single.goodput(slo) if single.goodput(slo) > 0 else float("inf")
    return {
        "slo": slo.describe(),
        "phases": phases,
        "every_phase_within_5pct": all(p["ok"] for p in phases),
        "best_single": single.arm,
        "best_single_goodput": round(single.goodput(slo), 2),
        "elastic_goodput": round(elastic.goodput(slo), 2),
        "over_best_single": round(ratio, 3),
        # the best fixed layout of each phase, switched for free at phase boundaries: what any
        # per-phase choice of layout can reach
        "per_phase_best_over_best_single": round(oracle / trace.duration_s / single.goodput(slo), 3),
        "over_best_single_ok": ratio >= OVER_BEST_SINGLE,
        # the pinned layouts with the pool's router and hold (--pinned): elastic against the best of them
        "held": {r.arm: round(r.goodput(slo), 2) for r in held},
        "over_best_held": round(elastic.goodput(slo) / max(r.goodput(slo) for r in held), 3)
        if held
        else None,
    }


def slow_judge(trace: Trace, slo: Slo, elastic: TraceRun, colocated: TraceRun) -> dict[str, Any]:
    parts = [*range(len(trace.phases)), None]
    pairs = [(elastic.goodput(slo, k), colocated.goodput(slo, k)) for k in parts]
    return {
        "slo": slo.describe(),
        "elastic": [round(e, 2) for e, _ in pairs],
        "colocated": [round(c, 2) for _, c in pairs],
        "ok": all(e >= (1 - WITHIN) * c for e, c in pairs),
    }


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    add_numbers(
        p, {"--instances": 8, "--phase-s": 30.0, "--burst-phase-s": 40.0, "--slow-gbps": 0.5, "--seed": 0}
    )
    p.add_argument("--profile", default="llama3-8b-h200")
    p.add_argument("--pinned", default="", help="prefill-side counts to run pinned with the hold, e.g. 5,0")
    p.add_argument("--skip-slow", action="store_true", help="leave out the slow link's runs")
    a = p.parse_args(argv)
    profile, n = load_profile(a.profile), a.instances
    slow = profile.with_kv_bandwidth(a.slow_gbps * 1e9)
    trace = the_trace(a.phase_s, a.burst_phase_s)
    began = time.process_time()
    print(f"SIMULATED: profile {profile.name}, {n} instances, virtual clock, seed {a.seed}; trace of "
          f"{trace.duration_s:g} s:\n" + "\n".join(f"  {k + 1}. {ph.describe()}" for k, ph in enumerate(trace.phases)))  # fmt: skip
    fixed = [replay(profile, trace, Fixed(x, n - x), a.seed) for x in range(1, n)]
    fixed.append(replay(profile, trace, Fixed(0, n), a.seed))
    colocated = fixed[-1]
    verdicts, slow_verdicts = [], []
    pinned = [int(x) for x in a.pinned.split(",") if x.strip()]
    for slo in SLOS:
        pool = ElasticPool(costs=profile.costs(), slo=slo)
        elastic = replay(profile, trace, Elastic(n, pool), a.seed)
        held = [replay(profile, trace, Elastic(n, replace(pool, num_prefill=x)), a.seed) for x in pinned]
        table(f"{slo.describe()}, KV link of {profile.kv_bandwidth_bytes_per_s / 1e9:.0f} GB/s", trace, slo,
              [elastic, *held, *fixed])  # fmt: skip
        verdicts.append(judge(trace, slo, elastic, fixed, held))
        if a.skip_slow:
            continue
        on_slow = replay(slow, trace, Elastic(n, ElasticPool(costs=slow.costs(), slo=slo)), a.seed)
        table(f"{slo.describe()}, KV link of {a.slow_gbps:g} GB/s", trace, slo, [on_slow, colocated])
        slow_verdicts.append(slow_judge(trace, slo, on_slow, colocated))
    cpu = time.process_time() - began
    print(f"\nCPU time: {cpu:.0f} s")
    for v in verdicts:
        print(f"{v['slo']}: every phase within 5 % of its best fixed layout: {v['every_phase_within_5pct']}; "
              f"{v['over_best_single']}x the best single fixed layout ({v['best_single']}), goal "
              f"{OVER_BEST_SINGLE}x: {v['over_best_single_ok']} (the best layout of each phase, switched "
              f"at no cost, would be {v['per_phase_best_over_best_single']}x)")  # fmt: skip
        if v["held"]:
            print(f"{v['slo']}: {v['over_best_held']}x the best pinned layout with the hold ({v['held']})")
    for v in slow_verdicts:
        print(f"{v['slo']} over {a.slow_gbps:g} GB/s: within 5 % of colocated: {v['ok']}")
    print_result({"fast": verdicts, "slow": slow_verdicts, "cpu_s": round(cpu),
                  "trace_s": trace.duration_s, "profile": profile.name, "instances": n})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
