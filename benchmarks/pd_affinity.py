"""PD's time to first token against one instance's, with vLLM's NIXL worker free to move its model thread
(``PDSERVE_KEEP_CPU_AFFINITY=0``, vLLM's own behaviour) and kept on its cores (pdserve's default).

vLLM's NIXL connector moves each CPU worker's model thread to the last core of each NUMA node
(engines/enginesite/sitecustomize.py says more), so on one host every instance computes on the same core.
Each round starts a 1P1D stack (`pdserve up` as it runs, default model, CPU) once per arm, in turn
(interleaved, so load from elsewhere falls on both arms alike), and sends ``--requests`` chat questions,
each twice: through the proxy (PD) and to the decode instance alone, both streamed, each under a fresh
``cache_salt`` so every prompt is computed (or pulled) anew. TTFT is the client's time to the first
content chunk. Per arm and path it prints the median and mean over all rounds, the answers' agreement,
which cores each instance's log says its model thread kept, and the load average around each arm.

    PYTHONPATH=src .venv/bin/python benchmarks/pd_affinity.py [--rounds 2] [--requests 12] [--first-port 26100]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pdserve.stack import Stack
from pdserve.topology import Topology

AFFINITY_ENV = "PDSERVE_KEEP_CPU_AFFINITY"
ARMS = {"vLLM moves it": "0", "kept on its cores": "1"}
QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the capital of Germany?",
)
KEPT_MARK = "asked to move its model thread"


def stream_ttft(url: str, model: str, question: str, max_tokens: int) -> tuple[float, str]:
    """(seconds to the first content chunk, the whole text) of one streamed greedy chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
    first: float | None = None
    parts: list[str] = []
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=120)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
        if delta:
            if first is None:
                first = time.perf_counter() - start
            parts.append(delta)
    conn.close()
    if first is None:
        raise RuntimeError(f"{url}: no content in the stream")
    return first, "".join(parts)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_arm(name: str, value: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    os.environ[AFFINITY_ENV] = value  # the instances inherit it: their sitecustomize reads it
    topology = Topology(
        model=args.model, proxy_port=args.first_port - 1, first_port=args.first_port,
        first_side_channel_port=args.first_port + 100, on_instance_exit="stop", run_dir=str(run_dir),
    )  # fmt: skip
    result: dict[str, Any] = {"arm": name, "pd": [], "alone": [], "equal": 0, "answers": set()}
    with Stack(topology, say=lambda m: print(f"  [{name}] {m}", flush=True)) as stack:
        assert stack.model is not None
        model = stack.model.served_model_name or stack.model.path
        stream_ttft(stack.proxy_url, model, QUESTIONS[0], args.max_tokens)  # warm-up: first handshake
        result["load_before"] = load()
        for i in range(args.requests):
            question = QUESTIONS[i % len(QUESTIONS)]
            pd_s, pd_text = stream_ttft(stack.proxy_url, model, question, args.max_tokens)
            alone_s, alone_text = stream_ttft(stack.urls("decode")[0], model, question, args.max_tokens)
            result["pd"].append(pd_s)
            result["alone"].append(alone_s)
            result["equal"] += pd_text == alone_text
            result["answers"].add(pd_text)
        result["load_after"] = load()
        logs = {s.name: stack.group.log_path(s) for s in stack.specs}
    result["kept"] = {n: [ln.split("): ", 1)[-1] for ln in p.read_text().splitlines() if KEPT_MARK in ln]
                      for n, p in logs.items()}  # fmt: skip
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=12, help="questions per arm per round")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="default: pdserve's default model")
    parser.add_argument("--first-port", type=int, default=26100)
    parser.add_argument("--run-dir", default="runs/pd-affinity")
    args = parser.parse_args()
    totals: dict[str, dict[str, list[float]]] = {n: {"pd": [], "alone": []} for n in ARMS}
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load {load()}")
    for r in range(args.rounds):
        for name, value in ARMS.items():
            res = run_arm(name, value, args, Path(args.run_dir) / f"round{r}-{value}")
            totals[name]["pd"] += res["pd"]
            totals[name]["alone"] += res["alone"]
            print(f"round {r + 1} {name}: PD TTFT median {statistics.median(res['pd']) * 1000:.0f} ms, "
                  f"alone {statistics.median(res['alone']) * 1000:.0f} ms; {res['equal']}/{len(res['pd'])} "
                  f"answers equal; load {res['load_before']} -> {res['load_after']}; answers "
                  f"{sorted(res['answers'])}; kept: {res['kept']}", flush=True)  # fmt: skip
    print("\n| model thread | PD TTFT median (mean) | one instance median (mean) | PD / one |")
    print("| --- | --- | --- | --- |")
    for name, t in totals.items():
        pd, alone = statistics.median(t["pd"]), statistics.median(t["alone"])
        print(f"| {name} | {pd * 1000:.0f} ms ({statistics.mean(t['pd']) * 1000:.0f}) | "
              f"{alone * 1000:.0f} ms ({statistics.mean(t['alone']) * 1000:.0f}) | {pd / alone:.1f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
