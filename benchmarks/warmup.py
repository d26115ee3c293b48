"""What a returning instance's warm-up is worth: the first PD requests after prefill restarts.

    flock /tmp/pdserve-vllm.lock .venv/bin/python benchmarks/warmup.py [--rounds 3] [--burst 4]

`pdserve up`'s Stack, 1P1D on the embedded tiny model (real vLLM, supervised), twice: with the proxy's
warm-up (a canary handoff per pair before a returning instance serves; ``--warmup-timeout``'s default)
and without it (``--warmup-timeout 0``). Each round SIGKILLs prefill, waits until the supervisor has it
back and the proxy's /health answers 200, then sends a burst of streamed PD requests at once (fresh
prompts, greedy): the requests a restart held back, arriving together. Reported per arm: the burst's
TTFT (median, max) against the same burst sent again once the pair is steady, and the seconds from the
supervisor's "ready" to the proxy's /health.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import aiohttp

from pdserve.bench.load import Job, send
from pdserve.config import ProxySettings
from pdserve.configparts import HealthChecks
from pdserve.stack import Stack, wait_http_ok
from pdserve.topology import Topology


async def burst(base: str, model: str, num: int) -> list[float]:
    """``num`` streamed PD requests sent at once: their TTFTs in ms (a failed one fails the run)."""
    prompt = "Tell me about the weather in the mountains today, and the rivers below them. " * 4
    jobs = [Job("/v1/completions", {"model": model, "prompt": f"{uuid.uuid4().hex} {prompt}", "max_tokens": 4,
                                    "temperature": 0, "stream": True}) for _ in range(num)]  # fmt: skip
    async with aiohttp.ClientSession() as http:
        outcomes = await asyncio.gather(*(send(http, base, job) for job in jobs))
    failed = [o.error for o in outcomes if not o.ok]
    assert not failed, failed
    return [o.ttft * 1000 for o in outcomes]


async def round_(stack: Stack, model: str, num: int) -> dict[str, Any]:
    spec = next(s for s in stack.specs if s.role == "prefill")
    since = time.monotonic()
    stack.group.kill(spec)
    ready_at = None
    while ready_at is None and time.monotonic() - since < 180:
        await asyncio.sleep(0.2)
        ready_at = next((at for at, e in list(stack.instance_events)
                         if at >= since and e.url == spec.url and e.kind == "ready"), None)  # fmt: skip
    assert ready_at is not None, "prefill not back within 180 s"
    assert await asyncio.to_thread(wait_http_ok, f"{stack.proxy_url}/health", 60)
    healthy_at = time.monotonic()
    first = await burst(stack.proxy_url, model, num)
    await asyncio.sleep(2.0)
    steady = await burst(stack.proxy_url, model, num)
    return {"ready_to_health_s": round(healthy_at - ready_at, 2), "first_ms": first, "steady_ms": steady}


def arm(warmup_timeout_s: float, rounds: int, num: int, port: int) -> dict[str, Any]:
    topology = Topology(model="tiny", proxy_port=port, first_port=port + 10, first_side_channel_port=port + 100,
                        on_instance_exit="restart")  # fmt: skip
    settings = ProxySettings(health=HealthChecks(warmup_timeout_s=warmup_timeout_s, interval_s=0.5))
    with Stack(topology, say=lambda m: print(f"[warmup] {m}", flush=True), proxy=settings) as stack:
        assert stack.model is not None
        model = stack.model.served_model_name or stack.model.path
        asyncio.run(burst(stack.proxy_url, model, num))  # the first handshake of the session, not counted
        done = [asyncio.run(round_(stack, model, num)) for _ in range(rounds)]
    first = [t for r in done for t in r["first_ms"]]
    steady = [t for r in done for t in r["steady_ms"]]
    return {
        "warmup_timeout_s": warmup_timeout_s,
        "first_ttft_ms_median": round(statistics.median(first), 1),
        "first_ttft_ms_max": round(max(first), 1),
        "steady_ttft_ms_median": round(statistics.median(steady), 1),
        "steady_ttft_ms_max": round(max(steady), 1),
        "ready_to_health_s": [r["ready_to_health_s"] for r in done],
        "rounds": done,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst", type=int, default=4, help="requests sent at once after each restart")
    p.add_argument("--port", type=int, default=23500)
    a = p.parse_args()
    result = {
        name: arm(timeout, a.rounds, a.burst, a.port) for name, timeout in (("warm", 30.0), ("cold", 0.0))
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
