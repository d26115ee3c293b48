"""A small load generator for OpenAI-compatible servers, measuring what `vllm bench serve` measures.

TTFT = send → first chunk with choices; ITL = gaps between later chunks with choices;
TPOT = (E2EL − TTFT) / (output chunks − 1). Requests are streamed; a fixed number run concurrently.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdserve import sse


@dataclass(frozen=True)
class Job:
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]  # stream is forced on


@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    begun: float = 0.0  # time.perf_counter() when it was sent: lines requests up on one timeline
    itls: list[float] = field(default_factory=list)
    num_chunks: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Summary:
    num_ok: int
    num_failed: int
    duration_s: float
    req_per_s: float
    chunks_per_s: float  # streamed token chunks per second (one token per chunk in vLLM)
    ttft_median_ms: float
    ttft_p90_ms: float
    itl_median_ms: float
    itl_p90_ms: float
    tpot_median_ms: float
    e2e_median_ms: float
    first_error: str | None

    def as_row(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (the value a ``q`` share of ``values`` lies below); NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(session: aiohttp.ClientSession, base: str, job: Job, timeout: float) -> Outcome:
    body = {**job.body, "stream": True}
    begun = time.perf_counter()
    first = last = 0.0
    out = Outcome(ok=False, begun=begun)
    try:
        async with asyncio.timeout(timeout):
            async with session.post(base + job.path, data=orjson.dumps(body)) as resp:
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                    return out
                reader = sse.EventReader()
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    for event in reader.feed(chunk):
                        if event == sse.DONE_PAYLOAD:
                            out.ok = out.error is None
                        elif (error := sse.error_of(event)) is not None:
                            out.error = str(error)[:200]
                        elif b'"choices":[]' not in event and b'"choices": []' not in event:
                            if out.num_chunks == 0:
                                first = now
                            else:
                                out.itls.append(now - last)
                            last = now
                            out.num_chunks += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        out.ok = False
    out.ttft = first - begun if out.num_chunks else 0.0
    out.e2e = time.perf_counter() - begun
    return out


async def run_load(
    base: str, jobs: Sequence[Job], concurrency: int, timeout: float = 120.0
) -> tuple[Summary, list[Outcome]]:
    """Run ``jobs`` with at most ``concurrency`` in flight; one pooled session for all of them."""
    queue = list(reversed(jobs))
    outcomes: list[Outcome] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def worker() -> None:
            while queue:
                outcomes.append(await _one(session, base, queue.pop(), timeout))

        begun = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - begun
    return summarize(outcomes, duration), outcomes


def summarize(outcomes: Sequence[Outcome], duration: float) -> Summary:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft * 1000 for o in ok]
    itls = [x * 1000 for o in ok for x in o.itls]
    tpots = [(o.e2e - o.ttft) * 1000 / (o.num_chunks - 1) for o in ok if o.num_chunks > 1]
    failed = [o for o in outcomes if not o.ok]
    return Summary(
        num_ok=len(ok),
        num_failed=len(failed),
        duration_s=duration,
        req_per_s=len(ok) / duration if duration else 0.0,
        chunks_per_s=sum(o.num_chunks for o in ok) / duration if duration else 0.0,
        ttft_median_ms=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p90_ms=percentile(ttfts, 0.9),
        itl_median_ms=statistics.median(itls) if itls else float("nan"),
        itl_p90_ms=percentile(itls, 0.9),
        tpot_median_ms=statistics.median(tpots) if tpots else float("nan"),
        e2e_median_ms=statistics.median([o.e2e * 1000 for o in ok]) if ok else float("nan"),
        first_error=failed[0].error if failed else None,
    )
