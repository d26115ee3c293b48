"""Prefix-aware prefill routing vs round robin on a shared-prefix workload, simulated 4P4D.

Each policy gets a fresh simulated cluster (`pdserve sim`, 4 prefill + 4 decode, a GPU-derived timing
profile) and the pdserve proxy in front, and the same workload: T tenants, each with its own long
system prompt, sending requests that add a short unique question to it, shuffled together. Reported
per policy: prefill-side prefix-cache hit rate (from the instances' vllm:prefix_cache_* metrics) and
TTFT mean/median/p90 as the client saw it.

    .venv/bin/python benchmarks/prefix_routing.py [--profile llama3-8b-a100] [--tenants 8] [--per-tenant 24]

Prompts are sent as token-id lists, so the proxy and the simulator agree on tokens exactly; the proxy
still needs a tokenizer directory to turn prompt-aware routing on (the embedded model's is used).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _common import add_numbers, script_parser
from pdserve.bench.load import Job, run_load
from pdserve.prometheus import parse_prometheus
from pdserve.sim.profile import load_profile
from pdserve.stack import wait_http_ok

HOST = "127.0.0.1"


def wait_ok(url: str, timeout: float = 30.0) -> None:
    if not wait_http_ok(url, timeout):
        raise RuntimeError(f"{url} not healthy within {timeout} s")


def workload(tenants: int, per_tenant: int, prefix_len: int, suffix_len: int, max_tokens: int, seed: int,
             model: str) -> list[Job]:  # fmt: skip
    rng = random.Random(seed)
    prefixes = [[rng.randrange(200, 1500) for _ in range(prefix_len)] for _ in range(tenants)]
    jobs = []
    for t in range(tenants):
        for _ in range(per_tenant):
            prompt = prefixes[t] + [rng.randrange(200, 1500) for _ in range(suffix_len)]
            jobs.append(Job("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True}))  # fmt: skip
    rng.shuffle(jobs)
    return jobs


def prefill_hits(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            samples = parse_prometheus(resp.read().decode())
        hits += samples.get("vllm:prefix_cache_hits_total", 0.0)
        queries += samples.get("vllm:prefix_cache_queries_total", 0.0)
    return hits, queries


def run_policy(policy: str, args: argparse.Namespace, tokenizer: str) -> dict[str, float]:
    p = args.first_port
    profile = load_profile(args.profile)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        sim = [sys.executable, "-m", "pdserve.sim", "--prefill", "4", "--decode", "4", "--first-port", str(p),
               "--profile", args.profile]  # fmt: skip
        procs.append(subprocess.Popen(sim, stdout=(logs / f"sim-{policy}.log").open("wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        prefill = [f"http://{HOST}:{p + i}" for i in range(4)]
        decode = [f"http://{HOST}:{p + 4 + i}" for i in range(4)]
        for url in prefill + decode:
            wait_ok(url + "/health")
        proxy = [sys.executable, "-m", "pdserve.cli", "proxy", "--port", str(p + 8), "--tokenizer", tokenizer,
                 "--block-size", str(profile.block_size), "--prefill-policy", policy]  # fmt: skip
        for url in prefill:
            proxy += ["--prefill", url]
        for url in decode:
            proxy += ["--decode", url]
        procs.append(subprocess.Popen(proxy, stdout=(logs / f"proxy-{policy}.log").open("wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        wait_ok(f"http://{HOST}:{p + 8}/health")
        jobs = workload(args.tenants, args.per_tenant, args.prefix_tokens, args.suffix_tokens, args.max_tokens,
                        args.seed, profile.served_model_name)  # fmt: skip
        summary, outcomes = asyncio.run(run_load(f"http://{HOST}:{p + 8}", jobs, args.concurrency))
        hits, queries = prefill_hits(prefill)
        ttfts = [o.ttft * 1000 for o in outcomes if o.ok]
        return {
            "ok": summary.num_ok, "failed": summary.num_failed, "hit_rate": hits / queries if queries else 0.0,
            "ttft_mean_ms": statistics.fmean(ttfts), "ttft_p50_ms": summary.ttft_median_ms,
            "ttft_p90_ms": summary.ttft_p90_ms, "req_per_s": summary.req_per_s,
        }  # fmt: skip
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--profile", default="llama3-8b-a100")
    add_numbers(parser, {"--tenants": 8, "--per-tenant": 24, "--prefix-tokens": 2048, "--suffix-tokens": 64})
    add_numbers(parser, {"--max-tokens": 16, "--concurrency": 16, "--seed": 0, "--first-port": 20300})
    parser.add_argument("--tokenizer", help="model dir with tokenizer.json (default: the embedded model's)")
    parser.add_argument("--logs", default="/tmp/pdserve-bench")
    args = parser.parse_args()
    if args.tokenizer is None:
        from pdserve.engines.model import embedded_model_dir

        args.tokenizer = str(embedded_model_dir())
    results = {policy: run_policy(policy, args, args.tokenizer) for policy in ("round_robin", "prefix_aware")}
    print(f"\nsimulated 4P4D, profile {args.profile}; {args.tenants} tenants x {args.per_tenant} requests, "
          f"{args.prefix_tokens}-token shared prefix + {args.suffix_tokens} unique, {args.max_tokens} out, "
          f"concurrency {args.concurrency}; {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(
        f"{'prefill policy':15} {'ok':>4} {'failed':>6} {'prefix hit rate':>16} {'TTFT mean':>10} {'TTFT p50':>9} {'TTFT p90':>9}"
    )
    for policy, r in results.items():
        print(f"{policy:15} {r['ok']:4.0f} {r['failed']:6.0f} {r['hit_rate']:15.1%} {r['ttft_mean_ms']:8.1f}ms "
              f"{r['ttft_p50_ms']:7.1f}ms {r['ttft_p90_ms']:7.1f}ms")  # fmt: skip
    rr, pa = results["round_robin"], results["prefix_aware"]
    print(f"prefix_aware vs round_robin: hit rate {pa['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
          f"mean TTFT {pa['ttft_mean_ms'] / rr['ttft_mean_ms']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
