"""What the proxy costs: pdserve vs vllm-router (Rust) in front of the same simulated P/D pair.

Both proxies front one zero-cost simulated prefill and decode instance (`pdserve sim`, profile "zero"),
so the engines cost nothing and the numbers are the proxies' own. The same streamed workload runs
through each, side by side in one run, plus straight to the decode instance (no PD) as the floor.

    .venv/bin/python benchmarks/proxy_overhead.py [--requests 400] [--concurrency 32] [--router PATH]
        [--rounds 3] [--baseline-src /tmp/old/src]

vllm-router is not a pdserve dependency; give its binary with --router (e.g. from a throwaway venv:
`python -m venv /tmp/router && /tmp/router/bin/pip install vllm-router`), or it is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.bench.load import Job, Summary, run_load
from pdserve.stack import wait_http_ok

HOST = "127.0.0.1"


def wait_ok(url: str, timeout: float = 30.0) -> None:
    if not wait_http_ok(url, timeout):
        raise RuntimeError(f"{url} not healthy within {timeout} s")


@contextmanager
def process(cmd: list[str], health: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})  # fmt: skip
    try:
        wait_ok(health)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def jobs(n: int, max_tokens: int) -> list[Job]:
    body = {"model": "sim-model", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [
        Job("/v1/completions", {**body, "prompt": f"request {i}: " + "lorem ipsum " * 40}) for i in range(n)
    ]


def measure(base: str, n: int, concurrency: int, max_tokens: int) -> Summary:
    asyncio.run(run_load(base, jobs(min(n, 2 * concurrency), max_tokens), concurrency))  # warm-up
    summary, _ = asyncio.run(run_load(base, jobs(n, max_tokens), concurrency))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are reported")
    parser.add_argument("--router", default=shutil.which("vllm-router"), help="vllm-router binary")
    parser.add_argument("--baseline-src", metavar="DIR",
                        help="another pdserve checkout's src/ (e.g. `git worktree add /tmp/old HEAD~1`): its "
                             "proxy runs beside this one, for before/after comparisons")  # fmt: skip
    parser.add_argument("--first-port", type=int, default=20100)
    parser.add_argument("--logs", default="/tmp/pdserve-bench")
    args = parser.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    p = args.first_port
    prefill, decode = f"http://{HOST}:{p}", f"http://{HOST}:{p + 1}"
    sim = [sys.executable, "-m", "pdserve.sim", "--prefill", "1", "--decode", "1", "--first-port", str(p)]
    proxies: dict[str, tuple[list[str], str, dict[str, str]]] = {}

    def pdserve_proxy(port: int) -> list[str]:
        return [sys.executable, "-m", "pdserve.cli", "proxy", "--prefill", prefill, "--decode", decode,
                "--port", str(port)]  # fmt: skip

    proxies["pdserve proxy (PD)"] = (pdserve_proxy(p + 2), f"http://{HOST}:{p + 2}", {})
    if args.baseline_src:
        env = {"PYTHONPATH": str(Path(args.baseline_src).resolve())}
        proxies["pdserve baseline (PD)"] = (pdserve_proxy(p + 5), f"http://{HOST}:{p + 5}", env)
    if args.router:
        router = [args.router, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                  "--host", HOST, "--port", str(p + 3), "--policy", "round_robin",
                  "--prometheus-port", str(p + 4)]  # fmt: skip
        proxies["vllm-router (PD)"] = (router, f"http://{HOST}:{p + 3}", {})
    samples: dict[str, list[Summary]] = {"direct to decode (no PD, floor)": []}
    samples.update({name: [] for name in proxies})
    with contextlib.ExitStack() as running:
        running.enter_context(process(sim, decode + "/health", logs / "sim.log"))
        wait_ok(prefill + "/health")
        bases = {"direct to decode (no PD, floor)": decode}
        for name, (cmd, base, env) in proxies.items():
            log = logs / (name.split()[0] + ("-baseline" if "baseline" in name else "") + ".log")
            running.enter_context(process(cmd, base + "/health", log, env))
            bases[name] = base
        for _ in range(args.rounds):
            for name, base in bases.items():
                samples[name].append(measure(base, args.requests, args.concurrency, args.max_tokens))
    rows = {name: _median(runs) for name, runs in samples.items()}
    base = rows.get("pdserve proxy (PD)")
    print(f"\n{args.requests} streamed completions x {args.max_tokens} tokens, concurrency {args.concurrency}, "
          f"{args.rounds} interleaved round(s), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(
        f"{'':34} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'failed':>6} {'tok/s vs pdserve':>17}"
    )
    for name, s in rows.items():
        ratio = s.chunks_per_s / base.chunks_per_s if base and base.chunks_per_s else float("nan")
        print(f"{name:34} {s.req_per_s:8.1f} {s.chunks_per_s:9.0f} {s.ttft_median_ms:8.1f}ms {s.ttft_p90_ms:8.1f}ms "
              f"{s.itl_median_ms:7.2f}ms {s.num_failed:6d} {ratio:16.2f}x")  # fmt: skip
        if s.first_error:
            print(f"   first error: {s.first_error}")
    (logs / "proxy_overhead.json").write_text(json.dumps({k: v.as_row() for k, v in rows.items()}, indent=2))
    return 0


def _median(runs: list[Summary]) -> Summary:
    """The round with the median tokens/s (a whole round, so its figures stay consistent)."""
    ordered = sorted(runs, key=lambda s: s.chunks_per_s)
    return ordered[len(ordered) // 2]


if __name__ == "__main__":
    sys.exit(main())
