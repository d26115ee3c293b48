"""Sim fidelity: the same fixed workload against a real vLLM instance and a calibrated sim, side by side.

The sim is one plain instance (role "both": vLLM without PD) started in this process, in its own thread, with
the given profile. Each phase runs ``--rounds`` times, alternating real and sim (the same prompts for both
within a round), and pools each side's samples, so drift in the machine's load touches both alike. Prompts are
lists of token ids: the sim's tokenizer is not the model's, so both sides get the same token count (and the
same ids) rather than the same text. Ids are fresh random draws per request, so no prefix cache hides prefill
work; greedy decoding with ``ignore_eos`` makes every answer exactly ``--output-tokens`` long.

Phases (defaults): 20 lone requests; 40 at concurrency 4; 40 at concurrency 8; each with a 200-token prompt
and 32 output tokens, 3 rounds. Per phase it prints the TTFT and ITL medians (as ``vllm bench serve`` defines
them) of real and sim, the ratio sim/real, and PASS if both ratios lie within ``1 ± --tolerance``. TPOT ((E2E
− TTFT) / (tokens − 1)) follows for information: unlike ITL it does not collapse to 0 when a busy API server
delivers a stream's chunks in bursts (many zero gaps), so it tells noise from model error.

    .venv/bin/python benchmarks/sim_fidelity.py --real http://localhost:9400 [--profile tiny-cpu]

Exit status: 0 if every phase passes, 1 if any fails; a failed request ends the run with a message.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from _common import add_numbers, script_parser
from pdserve.bench.load import Job, Outcome, Summary, run_load, summarize
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import load_profile


@dataclass(frozen=True)
class Phase:
    name: str
    requests: int
    concurrency: int


@dataclass(frozen=True)
class Result:
    phase: Phase
    real: Summary
    sim: Summary

    @property
    def ttft_ratio(self) -> float:
        return _ratio(self.sim.ttft_median_ms, self.real.ttft_median_ms)

    @property
    def itl_ratio(self) -> float:
        return _ratio(self.sim.itl_median_ms, self.real.itl_median_ms)


def _ratio(sim: float, real: float) -> float:
    """sim/real; infinite when real is 0 (a stream delivered in bursts has zero gaps: see the notes)."""
    return sim / real if real > 0 else math.inf


PHASES = (Phase("lone", 20, 1), Phase("conc4", 40, 4), Phase("conc8", 40, 8))


def make_jobs(rng: random.Random, args: argparse.Namespace, model: str, count: int) -> list[Job]:
    """``count`` streamed greedy completions, each a fresh random token-id prompt."""
    low, high = args.token_range
    return [
        Job(
            "/v1/completions",
            {
                "model": model,
                "prompt": [rng.randint(low, high) for _ in range(args.prompt_tokens)],
                "max_tokens": args.output_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        )
        for _ in range(count)
    ]


def check(summary: Summary, target: str, phase: str) -> None:
    if summary.num_failed:
        raise SystemExit(
            f"{target}, phase {phase}: {summary.num_failed} requests failed: {summary.first_error}"
        )


async def run_phases(real: str, sim: str, args: argparse.Namespace, model: str) -> list[Result]:
    rng = random.Random(args.seed)
    for url in (real, sim):  # connections, first-step costs, lazily built code paths
        check((await run_load(url, make_jobs(rng, args, model, 8), 4))[0], url, "warm-up")
    results = []
    for phase in PHASES:
        runs: dict[str, tuple[list[Outcome], list[float]]] = {"real": ([], []), "sim": ([], [])}
        for _ in range(args.rounds):  # real, sim, real, sim...: drift in the machine's load hits both
            jobs = make_jobs(rng, args, model, phase.requests)  # the same ids for both sides
            for side, url in (("real", real), ("sim", sim)):
                summary, outcomes = await run_load(url, jobs, phase.concurrency)
                check(summary, side, phase.name)
                runs[side][0].extend(outcomes)
                runs[side][1].append(summary.duration_s)
        pooled = {side: summarize(outs, sum(durations)) for side, (outs, durations) in runs.items()}
        results.append(Result(phase, pooled["real"], pooled["sim"]))
    return results


def render(results: Sequence[Result], tolerance: float) -> tuple[str, bool]:
    lines = [
        "| phase | requests × conc | TTFT real | TTFT sim | sim/real | ITL real | ITL sim | sim/real "
        "| verdict | TPOT real | TPOT sim | sim/real |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    all_ok = True
    for r in results:
        ok = all(abs(ratio - 1.0) <= tolerance for ratio in (r.ttft_ratio, r.itl_ratio))
        all_ok &= ok
        lines.append(
            f"| {r.phase.name} | {r.phase.requests} × {r.phase.concurrency} "
            f"| {r.real.ttft_median_ms:.2f} ms | {r.sim.ttft_median_ms:.2f} ms | {r.ttft_ratio:.2f} "
            f"| {r.real.itl_median_ms:.2f} ms | {r.sim.itl_median_ms:.2f} ms | {r.itl_ratio:.2f} "
            f"| {'PASS' if ok else 'FAIL'} "
            f"| {r.real.tpot_median_ms:.2f} ms | {r.sim.tpot_median_ms:.2f} ms "
            f"| {_ratio(r.sim.tpot_median_ms, r.real.tpot_median_ms):.2f} |"
        )
    return "\n".join(lines), all_ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--real", required=True, help="base URL of the real vLLM instance")
    parser.add_argument("--profile", default="tiny-cpu", help="sim profile: shipped name or YAML path")
    parser.add_argument("--model", help="model name in the requests (default: the profile's)")
    add_numbers(parser, {"--prompt-tokens": 200, "--output-tokens": 32})
    parser.add_argument(
        "--token-range", type=int, nargs=2, default=(200, 1500), metavar=("LOW", "HIGH"),
        help="prompt token ids are drawn from [LOW, HIGH] (inside the real model's vocabulary)",
    )  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=0.2, help="allowed |sim/real - 1| per median")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds per phase, alternating real and sim; samples are pooled"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    profile = load_profile(args.profile)
    model = args.model or profile.served_model_name
    load_before = os.getloadavg()
    with sim_in_thread([SimInstanceSpec("both")], profile) as cluster:
        results = asyncio.run(run_phases(args.real.rstrip("/"), cluster.urls[0], args, model))
    load_after = os.getloadavg()
    table, ok = render(results, args.tolerance)
    print(
        f"real {args.real} vs sim profile {profile.name!r}; {args.prompt_tokens}-token prompts, "
        f"{args.output_tokens} output tokens; medians; tolerance ±{args.tolerance:.0%}"
    )
    print(table)
    print(
        "load average (1/5/15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
            *load_before, *load_after
        )
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
