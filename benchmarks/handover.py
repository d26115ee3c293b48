"""Each hand-over sequence side by side: TTFT p50/p99 and ITL p50 at several concurrencies.

vLLM pairs a push connector only with a push connector, so the sequences need two pairs: a pull pair
(`pdserve up`'s default) and a push pair (`--kv-transfer push`), started one after the other (each
instance on its own core). On each pair the arms are proxies in front of the very same instances, plus
the decode instance alone:

    pull pair   pull (serial)              a proxy process
                pull + first token         a second proxy process, --first-token-at-once
                alone                      decode, addressed directly
    push pair   push (decode sent first)   a proxy process (after one request taught it prefill's id)
                push + first token         a second proxy process, --first-token-at-once
                alone                      decode, addressed directly

Both proxies of a pair are processes of their own, alike but for the flag (the stack's own proxy, on a
thread of this process beside the load client, is not timed). Rounds rotate the arms (round r starts with
arm r mod 3); each round sends ``--requests`` streamed greedy completions per concurrency (at least as
many as the concurrency), every prompt fresh (its own words and ``cache_salt``). TTFT is the client's
time to the first chunk with text; ITL the gaps between text chunks. Answers are compared with decode's
own (greedy, float32). For each proxy arm, the medians of its requests' phases as its ``/requests``
timeline has them: prefill's call, the proxy's own gap between the legs, decode's request to its first
byte.

    PYTHONPATH=src .venv/bin/python benchmarks/handover.py [--rounds 2] [--requests 8] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.stack import Stack
from pdserve.topology import Topology


def _prompt(num_words: int) -> str:
    return " ".join(uuid.uuid4().hex[:5] for _ in range(num_words))


Result = tuple[float, list[float], str, str]  # TTFT, inter-token gaps, text, the proxy's request id
# The proxy's timeline of a request (/requests), as the table reports its phases.
_PHASES = {"prefill": "prefill_ms", "gap": "handoff_gap_ms", "decode first byte": "decode_first_byte_ms"}


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    """(TTFT, inter-token gaps, text, request id) of one streamed completion."""
    start = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        request_id = resp.headers.get("X-Request-Id", "")
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]" or not payload:
                    continue
                data = json.loads(payload)
                if "error" in data:
                    raise RuntimeError(f"{url}: error event {data['error']}")
                text = "".join(c.get("text") or "" for c in data.get("choices") or ())
                if text:
                    stamps.append(now)
                    parts.append(text)
    if not stamps:
        raise RuntimeError(f"{url}: no text in the stream")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - start, gaps, "".join(parts), request_id


def _phases(proxy: str, request_ids: list[str]) -> dict[str, list[float]]:
    """Each phase of these requests as the proxy's /requests timeline has it (ms)."""
    with urllib.request.urlopen(f"{proxy}/requests", timeout=10) as r:
        traces = {t["request_id"]: t for t in json.loads(r.read())["requests"]}
    out: dict[str, list[float]] = {name: [] for name in _PHASES}
    for rid in request_ids:
        timeline = (traces.get(rid) or {}).get("timeline") or {}
        for name, key in _PHASES.items():
            if timeline.get(key) is not None:
                out[name].append(timeline[key])
    return out


async def _batch(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[Result]:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def run(body: dict[str, Any]) -> Result:
            async with limit:
                return await _one(session, url, body)

        return await asyncio.gather(*(run(b) for b in bodies))


@contextmanager
def _proxy(stack: Stack, port: int, *flags: str) -> Iterator[str]:
    """A second pdserve proxy in front of the stack's instances."""
    args = [str(Path(sys.executable).parent / "pdserve"), "proxy", "--port", str(port), *flags]
    for url in stack.urls("prefill"):
        args += ["--prefill", url]
    for url in stack.urls("decode"):
        args += ["--decode", url]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"the proxy at {url} did not come up")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_pair(transfer: str, args: argparse.Namespace, base_port: int, run_dir: Path) -> dict[str, Any]:
    topology = Topology(model=args.model, kv_transfer=transfer, proxy_port=base_port, first_port=base_port + 10,  # type: ignore[arg-type]
                        first_side_channel_port=base_port + 50, on_instance_exit="stop",
                        run_dir=str(run_dir / transfer))  # fmt: skip
    figures: dict[str, Any] = {}
    with Stack(topology, say=lambda m: print(f"[{transfer}] {m}", flush=True)) as stack:
        assert stack.model is not None
        model = stack.model.served_model_name or stack.model.path
        with (
            _proxy(stack, base_port + 4) as plain,
            _proxy(stack, base_port + 5, "--first-token-at-once") as early,
        ):
            arms = {transfer: plain, f"{transfer} + first token": early, "alone": stack.urls("decode")[0]}
            for url in (plain, early):  # each proxy learns prefill's identity before timing
                body = {
                    "model": model,
                    "prompt": _prompt(8),
                    "max_tokens": 2,
                    "temperature": 0,
                    "stream": True,
                }
                asyncio.run(_batch(url, [body], 1))
            names = list(arms)
            for concurrency in args.concurrency:
                samples: dict[str, dict[str, list[float]]] = {n: {"ttft": [], "itl": []} for n in names}
                phases: dict[str, dict[str, list[float]]] = {n: {p: [] for p in _PHASES} for n in names[:2]}
                agree = total = 0
                for r in range(args.rounds):
                    bodies = [{"model": model, "prompt": _prompt(args.prompt_words), "max_tokens": args.max_tokens,
                               "temperature": 0, "stream": True, "cache_salt": uuid.uuid4().hex}
                              for _ in range(max(args.requests, concurrency))]  # fmt: skip
                    texts: dict[str, list[str]] = {}
                    for name in names[r % 3 :] + names[: r % 3]:
                        results = asyncio.run(_batch(arms[name], bodies, concurrency))
                        samples[name]["ttft"] += [r[0] for r in results]
                        samples[name]["itl"] += [g for r in results for g in r[1]]
                        texts[name] = [r[2] for r in results]
                        if name in phases:  # a proxy: where its requests' time went
                            for phase, values in _phases(arms[name], [r[3] for r in results]).items():
                                phases[name][phase] += values
                    for name in names:
                        agree += sum(a == b for a, b in zip(texts[name], texts["alone"], strict=True))
                        total += len(texts[name])
                figures[f"c={concurrency}"] = {
                    name: {"ttft_p50_ms": 1000 * statistics.median(s["ttft"]),
                           "ttft_p99_ms": 1000 * _quantile(s["ttft"], 0.99),
                           "itl_p50_ms": 1000 * statistics.median(s["itl"]) if s["itl"] else None,
                           "n": len(s["ttft"])}
                    for name, s in samples.items()
                }  # fmt: skip
                for name, by_phase in phases.items():
                    figures[f"c={concurrency}"][name]["phases_p50_ms"] = {
                        phase: round(statistics.median(v), 1) if v else None for phase, v in by_phase.items()
                    }
                figures[f"c={concurrency}"]["answers equal to alone"] = f"{agree}/{total}"
                print(
                    json.dumps({transfer: {f"c={concurrency}": figures[f"c={concurrency}"]}}, indent=1),
                    flush=True,
                )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--first-port", type=int, default=27000)
    parser.add_argument("--run-dir", default="runs/handover")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    results = {
        t: run_pair(t, args, args.first_port + 100 * i, run_dir) for i, t in enumerate(("pull", "push"))
    }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
