"""The flags and entry points of `pdserve bench` and `pdserve plan` (cli.py adds the topology flags).

Kept out of cli.py so the two commands' many flags live next to what they drive.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.workload import DATASETS, Workload
from pdserve.errors import BenchError, ConfigError
from pdserve.slo import Slo
from pdserve.topology import Topology

if TYPE_CHECKING:
    from pdserve.bench.plan import Plan


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "url", nargs="?", help="an OpenAI endpoint to measure (a proxy or one instance); not with --compare"
    )
    p.add_argument("--compare", action="store_true",
                   help="start the topology (kv_both) and run the workload disaggregated and colocated on it")  # fmt: skip
    w = p.add_argument_group("workload (vLLM's `vllm bench serve` runs it)")
    w.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random prompts, prefix (groups sharing a prefix), or sharegpt (a ShareGPT JSON file)")  # fmt: skip
    w.add_argument("--dataset-path", help="sharegpt: the file (default: a generated ShareGPT-format sample)")
    w.add_argument("--num-prompts", type=int, default=100, help="requests per run (default %(default)s)")
    w.add_argument(
        "--input-len", type=int, default=512, help="prompt tokens (random, prefix; default %(default)s)"
    )
    w.add_argument("--output-len", type=int, default=128, help="output tokens (default %(default)s)")
    w.add_argument("--prefix-len", type=int, default=256, help="prefix: shared tokens (default %(default)s)")
    w.add_argument(
        "--num-prefixes", type=int, default=4, help="prefix: distinct prefixes (default %(default)s)"
    )
    w.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], metavar="RPS",
                   help="one or more Poisson request rates (default inf: all at once)")  # fmt: skip
    w.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    w.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs in ms, vLLM's syntax: ttft:200 tpot:50 e2el:5000 (the verdict then goes by goodput)")  # fmt: skip
    w.add_argument("--num-warmups", type=int, default=2, help="warm-up requests before each run")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--tokenizer", help="tokenizer dir for vLLM's client (default: the model's; the sim's own)"
    )
    p.add_argument(
        "--result-dir", help="where vLLM's JSON results, plots and the report go (default runs/bench-<time>)"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--colocated-port", type=int, help="the colocated proxy's port (default: --port + 1)")
    p.add_argument("--sim-kv-gbps", type=float,
                   help="--engine sim: the simulated KV link's bandwidth in GB/s (a slow or fast link)")  # fmt: skip


def workload_from(a: argparse.Namespace) -> Workload:
    return Workload(
        dataset=a.dataset, num_prompts=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
        prefix_len=a.prefix_len, num_prefixes=a.num_prefixes, dataset_path=a.dataset_path,
        request_rates=tuple(a.request_rate), max_concurrency=a.max_concurrency, slo=Slo.parse(a.goodput),
        num_warmups=a.num_warmups, seed=a.seed,
    )  # fmt: skip


def _sim_profile_with_link(topology: Topology, gbps: float, out_dir: Path) -> Topology:
    """The topology's sim profile with its KV link at ``gbps``, written where the instances can read it."""
    import yaml

    from pdserve.sim.profile import load_profile

    if topology.engine != "sim":
        raise ConfigError("--sim-kv-gbps applies to --engine sim only")
    profile = load_profile(topology.sim_profile).with_kv_bandwidth(gbps * 1e9)
    path = out_dir / f"{profile.name}-{gbps:g}gbps.yaml"
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({**profile.to_mapping(), "name": path.stem}))
    return dataclasses.replace(topology, sim_profile=str(path))


def run_bench_command(a: argparse.Namespace, topology: Topology) -> int:
    from pdserve.bench.runner import run_bench, run_compare, summary_lines

    workload = workload_from(a)
    out_dir = Path(a.result_dir or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"workload: {workload.describe()}")
    if not a.compare:
        if not a.url:
            raise ConfigError(
                "pdserve bench needs a URL to measure, or --compare to start the instances itself"
            )
        results = run_bench(
            a.url, workload, out_dir, engine_python=topology.engine_python, tokenizer=a.tokenizer
        )
        print("\n".join(summary_lines(results)))
        print(f"vLLM's result JSON per run: {out_dir}/")
        return 0 if all(r.completed for r in results) else 1
    if a.url:
        raise ConfigError(
            "--compare starts its own instances: give the topology (--prefill, --decode, --engine ...), not a URL"
        )
    if a.sim_kv_gbps is not None:
        topology = _sim_profile_with_link(topology, a.sim_kv_gbps, out_dir)
    print(f"instances: {topology.prefill.count} prefill + {topology.decode.count} decode ({topology.engine}), "
          f"disaggregated, then the same {topology.num_instances} serving whole requests (colocated)")  # fmt: skip
    report = run_compare(topology, workload, out_dir, tokenizer=a.tokenizer, colocated_port=a.colocated_port,
                         make_plots=not a.no_plots)  # fmt: skip
    print("\n".join(report.lines()))
    # Inconclusive: a mode completed no request, so there is nothing to compare (scripts should notice).
    return 1 if report.verdict.decision == "inconclusive" else 0


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True,
                   help="capacity: a sim profile (shipped name or YAML; `pdserve sim calibrate URL` fits one from vLLM)")  # fmt: skip
    p.add_argument("--rate", type=float, required=True, help="target requests/s")
    p.add_argument("--input-len", type=int, help="prompt tokens (default: the --bench run's, else 512)")
    p.add_argument("--output-len", type=int, help="output tokens (default: the --bench run's, else 128)")
    p.add_argument("--slo", nargs="+", required=True, metavar="KEY:MS", help="ttft:MS tpot:MS (both needed)")
    p.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests meeting both SLOs (default 0.9)"
    )
    p.add_argument(
        "--kv-gbps", type=float, help="the KV link's bandwidth in GB/s (default: the profile's pull model)"
    )
    p.add_argument(
        "--bench",
        metavar="DIR",
        help="a `pdserve bench --compare` result: its measured KV bandwidth and lengths",
    )
    p.add_argument("--max-instances", type=int, default=64)
    p.add_argument("--check", action="store_true",
                   help="simulate the plan and its neighbours (one P or D more and fewer) and show their goodput")  # fmt: skip
    p.add_argument("--check-requests", type=int, default=400, metavar="N",
                   help="--check: Poisson requests per simulated layout (default %(default)s)")  # fmt: skip


def _measured(bench_dir: str) -> dict[str, Any]:
    """Bandwidth, lengths and prefill time from a --compare run's compare.json."""
    path = Path(bench_dir) / "compare.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read {path} (the summary `pdserve bench --compare` writes): {exc}") from exc
    size = seconds = 0.0
    prefill_ms = []
    ins, outs = [], []
    for rate in data.get("rates", []):
        d = rate["disaggregated"]
        if d.get("evidence"):
            size += d["evidence"]["transfer_bytes_sum"]
            seconds += d["evidence"]["transfer_s_sum"]
            if "prefill" in d["evidence"]["proxy_ms"]:
                prefill_ms.append(d["evidence"]["proxy_ms"]["prefill"])
        for mode in ("disaggregated", "colocated"):
            ins.append(rate[mode]["result"]["mean_input_len"])
            outs.append(rate[mode]["result"]["mean_output_len"])
    return {
        "bandwidth": size / seconds if seconds > 0 and size > 0 else None,
        "input_len": round(sum(ins) / len(ins)) if ins else None,
        "output_len": round(sum(outs) / len(outs)) if outs else None,
        "prefill_ms": min(prefill_ms) if prefill_ms else None,
    }


def run_plan_command(a: argparse.Namespace) -> int:
    from pdserve.bench import simcluster
    from pdserve.bench.plan import PlanRequest, plan
    from pdserve.sim.profile import load_profile

    if a.check_requests < 1:
        raise ConfigError(f"--check-requests must be >= 1, got {a.check_requests}")
    profile = load_profile(a.profile)
    measured = _measured(a.bench) if a.bench else {}
    bandwidth = a.kv_gbps * 1e9 if a.kv_gbps else measured.get("bandwidth")
    if bandwidth is not None and not a.kv_gbps:
        # NIXL's measured time per transfer includes its fixed cost: the effective rate stands for both.
        profile = dataclasses.replace(profile, kv_pull_base_s=0.0)
    req = PlanRequest(
        rate=a.rate, input_len=a.input_len or measured.get("input_len") or 512,
        output_len=a.output_len or measured.get("output_len") or 128, slo=Slo.parse(a.slo),
        attainment=a.attainment, kv_bandwidth_bytes_per_s=bandwidth, max_instances=a.max_instances,
    )  # fmt: skip
    result = plan(profile, req)
    if measured:
        shown = {k: v for k, v in measured.items() if v is not None}
        print(f"from {a.bench}: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))
        if measured.get("prefill_ms"):
            print(f"  (the profile predicts {result.prefill_s * 1000:.1f} ms per prefill; the bench's fastest mean "
                  f"prefill call was {measured['prefill_ms']:.1f} ms: if far apart, calibrate the profile)")  # fmt: skip
    print("\n".join(result.lines))
    if a.check:
        link = profile if bandwidth is None else profile.with_kv_bandwidth(bandwidth)
        print(f"on the simulator (virtual clock, {a.check_requests} Poisson requests):")
        chosen = result.recommended
        for x, y in _neighbourhood(result):
            load = simcluster.ClusterLoad(x, y, req.rate, req.input_len, req.output_len, a.check_requests)
            run = simcluster.run(link, load)
            name = f"{x}P{y}D" if x else f"{y} colocated"
            mark = "  <- the plan" if chosen and (chosen.num_prefill, chosen.num_decode) == (x, y) else ""
            print(f"  {name:<14} goodput {run.goodput(req.slo):6.2f} req/s, {run.goodput_per_instance(req.slo):5.2f} per "
                  f"instance; {run.attainment(req.slo):.0%} met the SLOs{mark}")  # fmt: skip
    return 0 if result.recommended is not None else 1


def _neighbourhood(result: Plan) -> list[tuple[int, int]]:
    """Each layout the plan found, then one instance more and one fewer of each role (fewer: is the
    plan padded?)."""
    out = []
    if result.disaggregated is not None:
        x, y = result.disaggregated.num_prefill, result.disaggregated.num_decode
        out += [
            (x, y),
            (x + 1, y),
            (x, y + 1),
            *([(x - 1, y)] if x > 1 else []),
            *([(x, y - 1)] if y > 1 else []),
        ]
    if result.colocated is not None:
        n = result.colocated.num_decode
        out += [(0, n), (0, n + 1), *([(0, n - 1)] if n > 1 else [])]
    return out
