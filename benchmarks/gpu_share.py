"""How one GPU shares itself between a decode-like and a prefill-like process (no MPS): the sim's device.py.

    python3 benchmarks/gpu_share.py [--out DIR] [--decode-ms 5] [--prefill-ms 150]

Two processes on cuda:0, torch only (no vLLM), each timing its own steps on the wall clock:
  decode   a CUDA graph of small memory-bound matmuls (16 rows against 8 bf16 weights of 4096x14336,
           repeated to about --decode-ms alone), like vLLM's decode graph: many short kernels reading weights
  prefill  back-to-back steps of large GEMMs (6400x4096 by 4096x14336 bf16, repeated to about --prefill-ms
           alone), like a 6,400-token prefill step, with a 2 ms CPU gap between steps
Phases on a common clock: decode alone (synced each step, then queued two deep as vLLM's async scheduling
keeps its next step queued), prefill alone, then both with decode synced, then both with decode queued.
For the phases with both it reports decode's steps split by whether a prefill step overlapped them, and
prefill's stretch: whether the GPU shares evenly (processor sharing: every overlapped decode step about
doubles) or by turns of some length (most decode steps keep their speed, some wait a turn).

Writes gpu_share.json (every step's start and end, and the summary) to --out; prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import add_numbers, script_parser

PHASES = (  # name, seconds, decode mode (None: idle), prefill active
    ("decode alone, synced", 2.0, "sync", False),
    ("decode alone, queued", 2.0, "queued", False),
    ("prefill alone", 2.0, None, True),
    ("both, decode synced", 5.0, "sync", True),
    ("both, decode queued", 5.0, "queued", True),
)


def child(role: str, target_ms: float) -> None:
    import torch

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    if role == "decode":
        weights = [torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16) for _ in range(8)]
        x = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
        out = torch.empty(16, 14336, device=dev, dtype=torch.bfloat16)

        def capture(reps: int) -> torch.cuda.CUDAGraph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for w in weights:  # warm the kernels up outside the graph
                    torch.matmul(x, w, out=out)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    for w in weights:
                        torch.matmul(x, w, out=out)
            return graph

        def timed(graph: torch.cuda.CUDAGraph, n: int = 20) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                graph.replay()
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / n

        one = timed(capture(1))
        reps = max(1, round(target_ms / 1e3 / one))
        graph = capture(reps)
        alone_s = timed(graph)
        step = graph.replay
    else:
        a = torch.randn(6400, 4096, device=dev, dtype=torch.bfloat16)
        b = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
        c = torch.empty(6400, 14336, device=dev, dtype=torch.bfloat16)
        torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        one = (time.perf_counter() - t) / 10
        reps = max(1, round(target_ms / 1e3 / one))

        def step() -> None:
            for _ in range(reps):
                torch.matmul(a, b, out=c)

        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        alone_s = time.perf_counter() - t
    print(
        json.dumps({"ready": role, "reps": reps, "kernel_ms": one * 1e3, "step_alone_ms": alone_s * 1e3}),
        flush=True,
    )
    t0 = float(sys.stdin.readline())
    steps: list[dict[str, Any]] = []
    begin = t0
    for name, seconds, mode, prefill_active in PHASES:
        end = begin + seconds
        active = mode is not None if role == "decode" else prefill_active
        while time.time() < begin:
            time.sleep(0.0005)
        if not active:
            begin = end
            continue
        if role == "prefill" or mode == "sync":
            gap = 0.002 if role == "prefill" else 0.0003  # the CPU's part between two steps
            while time.time() < end:
                s = time.time()
                step()
                torch.cuda.synchronize()
                steps.append({"phase": name, "start": s, "end": time.time()})
                time.sleep(gap)
        else:  # two deep: step k+1 is queued before step k is waited for
            pending: list[torch.cuda.Event] = []
            last = time.time()
            while time.time() < end or pending:
                if time.time() < end:
                    step()
                    event = torch.cuda.Event()
                    event.record()
                    pending.append(event)
                if len(pending) >= 2 or (pending and time.time() >= end):
                    pending.pop(0).synchronize()
                    now = time.time()
                    steps.append({"phase": name, "start": last, "end": now})
                    last = now
        begin = end
    torch.cuda.synchronize()
    print(json.dumps({"steps": steps}), flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p10": round(pct(values, 0.1), 2), "p50": round(pct(values, 0.5), 2),
            "p90": round(pct(values, 0.9), 2), "mean": round(statistics.fmean(values), 2)}  # fmt: skip


def summarize(decode: list[dict[str, Any]], prefill: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, *_ in PHASES:
        d = [s for s in decode if s["phase"] == name]
        p = [s for s in prefill if s["phase"] == name]
        row: dict[str, Any] = {}
        if p:
            row["prefill_step_ms"] = dist([1e3 * (s["end"] - s["start"]) for s in p])
        if d:
            ms = [1e3 * (s["end"] - s["start"]) for s in d[1:]]  # the first may include the phase's start
            row["decode_step_ms"] = dist(ms)
            if p:
                over: list[float] = []
                clear: list[float] = []
                for s, v in zip(d[1:], ms, strict=True):
                    hit = any(q["start"] < s["end"] and q["end"] > s["start"] for q in p)
                    (over if hit else clear).append(v)
                row["decode_step_ms_overlapped"] = dist(over)
                row["decode_step_ms_clear"] = dist(clear)
                busy = sum(q["end"] - q["start"] for q in p)
                row["prefill_busy_share"] = round(busy / (p[-1]["end"] - p[0]["start"]), 3)
        out[name] = row
    return out


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-share")))
    add_numbers(p, {"--decode-ms": 5.0, "--prefill-ms": 150.0})
    p.add_argument("--role", choices=("decode", "prefill"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role:
        child(a.role, a.decode_ms if a.role == "decode" else a.prefill_ms)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    procs, ready = {}, {}
    for role in ("decode", "prefill"):  # one after the other: neither calibrates against the other
        procs[role] = subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--decode-ms", str(a.decode_ms), "--prefill-ms", str(a.prefill_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        ready[role] = json.loads(procs[role].stdout.readline())  # type: ignore[union-attr]
        print(ready[role], flush=True)
    t0 = time.time() + 1.0
    for proc in procs.values():
        proc.stdin.write(f"{t0}\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    steps = {role: json.loads(proc.stdout.readline())["steps"] for role, proc in procs.items()}  # type: ignore[union-attr]
    for proc in procs.values():
        proc.wait(timeout=30)
    summary = summarize(steps["decode"], steps["prefill"])
    (a.out / "gpu_share.json").write_text(json.dumps({"ready": ready, "summary": summary, "steps": steps}))
    for name, row in summary.items():
        print(name)
        for key, value in row.items():
            print(f"  {key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
