"""`pdserve bench`: vLLM's benchmark client against one endpoint, or disaggregated against colocated.

``run_bench`` drives an endpoint that is already up. ``run_compare`` starts one topology with every
instance ``kv_both`` (topology.Topology.kv_both), puts two proxies in front of the same instances, the
pdserve PD proxy (prefill on the prefill instances, decode on the decode instances) and a colocated one
(every instance serves requests whole), and runs the workload through each in turn, at each rate, the
order alternating from rate to rate so drift on the machine does not always fall on the same mode. Each
run draws its prompts from the workload with a seed of its own and carries a ``cache_salt`` of its own
(bench/workload.py), so no run is served from another's prefix cache. vLLM's client is imported once,
while the instances start (bench/vllmbench.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import httpclient
from pdserve.bench import evidence as ev
from pdserve.bench.inputs import write_sharegpt_sample, write_sim_tokenizer
from pdserve.bench.plots import write_plots
from pdserve.bench.result import BenchResult, load_result
from pdserve.bench.verdict import Arm, Mode, RatePair, Verdict, decide, render
from pdserve.bench.vllmbench import BenchClient
from pdserve.bench.workload import Workload, client_args, rate_arg
from pdserve.config import ProxySettings
from pdserve.engines.venv import find_engine_python
from pdserve.errors import BenchError, ConfigError, Unreachable
from pdserve.proxy.serving.thread import proxy_for
from pdserve.stack import Stack, wait_http_ok
from pdserve.topology import Topology

SIM_ROOT_PREFIX = "pdserve-sim/"  # the simulator's /v1/models "root": it has no tokenizer on disk
_HEALTH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CompareReport:
    pairs: tuple[RatePair, ...]
    verdict: Verdict
    plots: tuple[Path, ...]
    out_dir: Path

    def lines(self) -> list[str]:
        out = render(self.pairs, self.verdict)
        out += [f"plot: {p}" for p in self.plots]
        return [*out, f"results (vLLM's JSON per run, this summary): {self.out_dir}/"]


class _Runs:
    """Names, seeds and salts of a session's runs, and the inputs each needs."""

    def __init__(self, workload: Workload, out_dir: Path, client: BenchClient, tokenizer: str | None) -> None:
        self.workload, self.out_dir, self.client, self.tokenizer = workload, out_dir, client, tokenizer
        self.count = 0
        self.timeout = 1800.0

    def run(self, url: str, rate: float, name: str) -> BenchResult:
        seed = self.workload.seed + self.count
        self.count += 1
        dataset_path = None
        if self.workload.dataset == "sharegpt" and self.workload.dataset_path is None:
            sample = self.out_dir / "inputs" / f"sharegpt-{seed}.json"
            dataset_path = str(write_sharegpt_sample(sample, max(self.workload.num_prompts, 16), seed))
        result_name = f"{name}.json"
        args = client_args(self.workload, url, rate, str(self.out_dir), result_name, seed=seed,
                           salt=f"pdserve-bench-{time.time_ns()}-{self.count}", tokenizer=self.tokenizer,
                           dataset_path=dataset_path, label=name)  # fmt: skip
        self.client.run(args, self.timeout)
        return load_result(self.out_dir / result_name, name)


def _tokenizer_for(url: str, explicit: str | None, out_dir: Path) -> str | None:
    """The tokenizer vLLM's client should count with: given, the sim's word tokenizer, or the model's own."""
    if explicit:
        return explicit
    try:
        models = httpclient.get(f"{url}/v1/models", 10.0).json()
        root = str(models["data"][0].get("root") or "")
    except (Unreachable, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"cannot read {url}/v1/models to find the model's tokenizer: {exc}") from exc
    if root.startswith(SIM_ROOT_PREFIX):
        return str(write_sim_tokenizer(out_dir / "sim-tokenizer"))
    return None  # vLLM's client reads /v1/models itself and loads the model's tokenizer from its root


def run_bench(
    url: str,
    workload: Workload,
    out_dir: Path,
    say: Callable[[str], None] = print,
    engine_python: str | None = None,
    tokenizer: str | None = None,
) -> list[BenchResult]:
    """Each rate of ``workload`` against ``url`` (an OpenAI endpoint); vLLM's JSON per run in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with BenchClient(find_engine_python(engine_python), out_dir / "vllm-bench.log") as client:
        runs = _Runs(workload, out_dir, client, _tokenizer_for(url, tokenizer, out_dir))
        for rate in workload.request_rates:
            say(f"vllm bench serve at {rate_arg(rate)} req/s against {url} ...")
            results.append(runs.run(url, rate, f"bench@{rate_arg(rate)}"))
    return results


def summary_lines(results: Sequence[BenchResult]) -> list[str]:
    lines = [f"{'run':<18}{'ok':>6}{'failed':>7}{'req/s':>8}{'tok/s':>9}{'goodput':>9}"
             f"{'TTFT p50/p90':>16}{'TPOT p50':>10}{'ITL p50/p90':>14}{'E2EL p50':>10}  (ms)"]  # fmt: skip
    for r in results:
        goodput = "-" if r.goodput is None else f"{r.goodput:.2f}"
        lines.append(f"{r.label:<18}{r.completed:>6}{r.failed:>7}{r.request_throughput:>8.2f}{r.output_throughput:>9.1f}"
                     f"{goodput:>9}{r.ttft.median:>8.1f}/{r.ttft.p90:<7.1f}{r.tpot.median:>10.2f}"
                     f"{r.itl.median:>7.2f}/{r.itl.p90:<6.2f}{r.e2el.median:>10.1f}")  # fmt: skip
    return lines


def run_compare(
    topology: Topology,
    workload: Workload,
    out_dir: Path,
    say: Callable[[str], None] = print,
    proxy: ProxySettings | None = None,
    tokenizer: str | None = None,
    colocated_port: int | None = None,
    make_plots: bool = True,
) -> CompareReport:
    out_dir.mkdir(parents=True, exist_ok=True)
    topology = dataclasses.replace(topology, kv_both=True, run_dir=str(out_dir / "logs"))
    coloc_port = colocated_port or topology.proxy_port + 1
    instance_ports = range(topology.first_port, topology.first_port + topology.num_instances)
    if coloc_port in instance_ports or coloc_port == topology.proxy_port:
        raise ConfigError(f"the colocated proxy's port {coloc_port} collides with the topology's ports")
    client = BenchClient(find_engine_python(topology.engine_python), out_dir / "vllm-bench.log")
    client.start()  # vLLM's import runs while the instances start
    pairs: list[RatePair] = []
    try:
        with Stack(topology, say=say, proxy=proxy) as stack:
            assert stack.proxy is not None
            urls = {"prefill": stack.urls("prefill"), "decode": stack.urls("decode")}
            every = (*urls["prefill"], *urls["decode"])
            pd = stack.proxy.config  # colocated: every instance in one decode pool, no prefill pool
            config = dataclasses.replace(pd, pools=(dataclasses.replace(pd.pool("decode"), urls=every),),
                                         port=coloc_port, otlp_traces_endpoint=None)  # fmt: skip
            colocated = proxy_for(config)
            colocated.start()
            try:
                proxies: dict[Mode, str] = {"disaggregated": stack.proxy_url, "colocated": colocated.url}
                pools: dict[Mode, dict[str, Sequence[str]]] = {
                    "disaggregated": dict(urls),
                    "colocated": {"colocated": every},
                }
                for url in proxies.values():
                    if not wait_http_ok(f"{url}/health", _HEALTH_TIMEOUT_S):
                        raise BenchError(
                            f"proxy {url} did not report healthy instances within {_HEALTH_TIMEOUT_S:.0f} s"
                        )
                runs = _Runs(workload, out_dir, client, _tokenizer_for(stack.proxy_url, tokenizer, out_dir))
                for i, rate in enumerate(workload.request_rates):
                    order: tuple[Mode, Mode] = (
                        ("disaggregated", "colocated") if i % 2 == 0 else ("colocated", "disaggregated")
                    )
                    arms = {}
                    for mode in order:
                        say(
                            f"{mode} at {rate_arg(rate)} req/s: {workload.num_prompts} requests via {proxies[mode]} ..."
                        )
                        arms[mode] = _measured(runs, mode, rate, proxies[mode], every, pools[mode])
                    pairs.append(RatePair(rate, arms["disaggregated"], arms["colocated"]))
            finally:
                colocated.stop()
    finally:
        client.close()
    verdict = decide(pairs)
    plots: list[Path] = []
    if make_plots:
        plots, why_not = write_plots(pairs, out_dir)
        if why_not:
            say(why_not)
    report = CompareReport(tuple(pairs), verdict, tuple(plots), out_dir)
    write_summary(report, topology, workload)
    return report


def _measured(
    runs: _Runs, mode: Mode, rate: float, url: str, instances: Sequence[str], pools: dict[str, Sequence[str]]
) -> Arm:
    before, proxy_before = ev.scrape_sum(instances), ev.scrape_sum([url])
    with ev.QueueSampler(pools) as sampler:
        result = runs.run(url, rate, f"{mode}@{rate_arg(rate)}")
    evidence = ev.RunEvidence.between(
        before, ev.scrape_sum(instances), proxy_before, ev.scrape_sum([url]), sampler.loads()
    )
    time.sleep(0.5)  # let the last handoffs settle before the next run's counters are read
    return Arm(mode, result, evidence)


def write_summary(report: CompareReport, topology: Topology, workload: Workload) -> None:
    """``compare.json`` (what `pdserve plan --bench DIR` reads) and ``report.txt`` in the report's folder."""

    def arm(a: Arm) -> dict[str, Any]:
        result = {k: v for k, v in dataclasses.asdict(a.result).items() if not k.endswith("s_ms")}
        return {"result": result, "evidence": dataclasses.asdict(a.evidence) if a.evidence else None}

    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "topology": {"engine": topology.engine, "sim_profile": topology.sim_profile, "model": topology.model,
                     "num_prefill": topology.prefill.count, "num_decode": topology.decode.count, "device": topology.device},
        "workload": dataclasses.asdict(workload),
        "verdict": dataclasses.asdict(report.verdict),
        "rates": [{"rate": rate_arg(p.rate), "disaggregated": arm(p.disaggregated), "colocated": arm(p.colocated)}
                  for p in report.pairs],
    }  # fmt: skip
    (report.out_dir / "compare.json").write_text(json.dumps(summary, indent=2, default=str))
    (report.out_dir / "report.txt").write_text("\n".join(report.lines()) + "\n")
