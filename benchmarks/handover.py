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
many as the concurrency), every prompt fresh (its own words), and each arm sends it under a ``cache_salt``
of its own: the arms share instances, and an arm must not find the prompt in a prefix cache that the arm
before it filled (the same salt everywhere made a later arm's prefill, or decode alone, a cache hit and
its first token early). TTFT is the client's time to the first chunk with text; ITL the gaps between
text chunks. Answers are compared with decode's own (greedy; float32 on CPU, bf16 on a GPU, where near
ties flip between batches). For each proxy arm, the medians of its requests' phases as its ``/requests``
timeline has them: prefill's call, the proxy's own gap between the legs, decode's request to its first
byte.

For each pair, the KV it moved while the arms ran, from the moving instance's ``/metrics`` (decode in
pull mode, prefill in push mode): transfers, bytes, NIXL's transfer and post time, descriptors, and the
rate per transfer. ``--block-size`` starts the pairs with that KV block size (fewer, larger descriptors).

    PYTHONPATH=src .venv/bin/python benchmarks/handover.py [--rounds 2] [--requests 8] [--concurrency 1,8,32]
        [--transfers pull,push] [--device cpu|cuda] [--model tiny|DIR] [--vllm-arg=--enforce-eager ...]
        [--block-size N] [--out FILE]
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.prometheus import BYTES_SUM, DESCRIPTORS_SUM, XFER_COUNT, XFER_TIME_SUM, scrape
from pdserve.stack import Stack
from pdserve.topology import Topology

POST_TIME_SUM = "vllm:nixl_post_time_seconds_sum"
_KV_SUMS = {"transfers": XFER_COUNT, "bytes": BYTES_SUM, "xfer_s": XFER_TIME_SUM, "post_s": POST_TIME_SUM,
            "descriptors": DESCRIPTORS_SUM}  # fmt: skip


def _prompt(num_words: int) -> str:
    return " ".join(uuid.uuid4().hex[:5] for _ in range(num_words))


# TTFT, inter-token gaps, text, the proxy's request id, prompt tokens (the usage chunk's)
Result = tuple[float, list[float], str, str, int]
# The proxy's timeline of a request (/requests), as the table reports its phases.
_PHASES = {"prefill": "prefill_ms", "gap": "handoff_gap_ms", "decode first byte": "decode_first_byte_ms"}


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    """(TTFT, inter-token gaps, text, request id, prompt tokens) of one streamed completion."""
    start = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    prompt_tokens = 0
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
                prompt_tokens = (data.get("usage") or {}).get("prompt_tokens") or prompt_tokens
                text = "".join(c.get("text") or "" for c in data.get("choices") or ())
                if text:
                    stamps.append(now)
                    parts.append(text)
    if not stamps:
        raise RuntimeError(f"{url}: no text in the stream")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - start, gaps, "".join(parts), request_id, prompt_tokens


def _kv(url: str) -> dict[str, float]:
    samples = scrape(url, 10)
    return {name: samples.get(metric, 0.0) for name, metric in _KV_SUMS.items()}


def _kv_moved(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What one pair moved between two scrapes, per transfer and as a rate (GiB/s of NIXL's own time)."""
    d = {k: after[k] - before[k] for k in before}
    n = d["transfers"] or 1.0
    return {
        "transfers": d["transfers"],
        "mb_per_transfer": round(d["bytes"] / n / 1e6, 2),
        "descriptors_per_transfer": round(d["descriptors"] / n, 1),
        "xfer_ms_per_transfer": round(1e3 * d["xfer_s"] / n, 3),
        "post_ms_per_transfer": round(1e3 * d["post_s"] / n, 3),
        "gib_per_s": round(d["bytes"] / d["xfer_s"] / 2**30, 2) if d["xfer_s"] else None,
    }


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
    # the module, not a console script: a host that runs pdserve from its source has none
    args = [sys.executable, "-m", "pdserve.cli", "proxy", "--port", str(port), *flags]
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


def run_pair(
    transfer: str,
    args: argparse.Namespace,
    base_port: int,
    run_dir: Path,
    keep: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """The pair's figures; ``keep`` has them after each concurrency, so a run cut short keeps what it
    measured."""
    vllm_args = tuple(args.vllm_arg) + ((f"--block-size={args.block_size}",) if args.block_size else ())
    topology = Topology(model=args.model, kv_transfer=transfer, proxy_port=base_port, first_port=base_port + 10,  # type: ignore[arg-type]
                        first_side_channel_port=base_port + 50, on_instance_exit="stop", device=args.device,
                        vllm_args=vllm_args, run_dir=str(run_dir / transfer))  # fmt: skip
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
            mover = stack.urls("prefill" if transfer == "push" else "decode")[0]
            kv_before = _kv(mover)
            prompt_tokens: list[int] = []
            for concurrency in args.concurrency:
                samples: dict[str, dict[str, list[float]]] = {n: {"ttft": [], "itl": []} for n in names}
                phases: dict[str, dict[str, list[float]]] = {n: {p: [] for p in _PHASES} for n in names[:2]}
                agree = total = 0
                for r in range(args.rounds):
                    bodies = [{"model": model, "prompt": _prompt(args.prompt_words), "max_tokens": args.max_tokens,
                               "temperature": 0, "stream": True, "cache_salt": uuid.uuid4().hex,
                               "stream_options": {"include_usage": True}}
                              for _ in range(max(args.requests, concurrency))]  # fmt: skip
                    texts: dict[str, list[str]] = {}
                    for name in names[r % 3 :] + names[: r % 3]:
                        own = [{**b, "cache_salt": f"{b['cache_salt']}-{names.index(name)}"} for b in bodies]
                        results = asyncio.run(_batch(arms[name], own, concurrency))
                        samples[name]["ttft"] += [r[0] for r in results]
                        samples[name]["itl"] += [g for r in results for g in r[1]]
                        texts[name] = [r[2] for r in results]
                        prompt_tokens += [r[4] for r in results if r[4]]
                        if name in phases:  # a proxy: where its requests' time went
                            for phase, values in _phases(arms[name], [r[3] for r in results]).items():
                                phases[name][phase] += values
                    for name in names[:2]:  # the two proxies' answers against decode alone's
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
                keep(figures)
                print(
                    json.dumps({transfer: {f"c={concurrency}": figures[f"c={concurrency}"]}}, indent=1),
                    flush=True,
                )
            figures["kv"] = _kv_moved(kv_before, _kv(mover))
            figures["prompt_tokens_p50"] = statistics.median(prompt_tokens) if prompt_tokens else None
            print(json.dumps({transfer: {"kv": figures["kv"]}}), flush=True)
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
    parser.add_argument("--transfers", default="pull,push", help="the pairs to start, in turn")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--vllm-arg", action="append", default=[],
                        help="an extra vLLM argument for every instance (repeat; --vllm-arg=--enforce-eager)")  # fmt: skip
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's --block-size for both pairs")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def keep(transfer: str, figures: dict[str, Any]) -> None:
        results[transfer] = figures
        if args.out:  # what is measured survives a later failure, or the run's deadline
            args.out.write_text(json.dumps(results, indent=1))

    for i, transfer in enumerate(args.transfers.split(",")):
        keep(transfer, run_pair(transfer, args, args.first_port + 100 * i, run_dir, partial(keep, transfer)))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
