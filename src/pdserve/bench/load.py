"""pdserve's own load generator for OpenAI-compatible servers, measuring what `vllm bench serve` measures.

TTFT = send → first chunk with choices; ITL = gaps between later chunks with choices;
TPOT = (E2EL − TTFT) / (output chunks − 1). ``run_load`` streams every request, a fixed number at once;
``send`` is one request as its job says (streamed or whole), keeping the answer's text, so a caller that
judges answers (benchmarks/soak.py) sends through the same client. `pdserve bench` itself drives vLLM's
client instead (bench/vllmbench.py), so its figures are vLLM's by definition.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdserve import sse


@dataclass(frozen=True)
class Job:
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]  # run_load forces stream on
    headers: Mapping[str, str] = field(default_factory=dict)  # e.g. X-Request-Id


@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    begun: float = 0.0  # time.perf_counter() when it was sent: lines requests up on one timeline
    itls: list[float] = field(default_factory=list)
    num_chunks: int = 0
    error: str | None = None  # why it failed: the error's message, without the status
    status: int = 0  # the HTTP status; 0: none came
    text: str = ""  # the answer's text (streamed: as far as it came)
    retry_after_s: float = 0.0  # the server's Retry-After, on a refusal
    is_timed_out: bool = False  # no end within the client's deadline
    is_hung_up: bool = False  # the client hung up after ``hang_up_after`` chunks, as asked

    @property
    def why(self) -> str | None:
        """The failure as a summary shows it."""
        if self.error is None or self.status in (0, 200):
            return self.error
        return f"HTTP {self.status}: {self.error}"


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


def text_of(choice: Mapping[str, Any]) -> str:
    """A choice's text: a completion's, or a chat message's (whole) or delta's (streamed) content."""
    if "text" in choice:
        return str(choice.get("text") or "")
    part = choice.get("message") or choice.get("delta") or {}
    return str(part.get("content") or "")


def _error_message(raw: bytes) -> str:
    """vLLM's (and pdserve's) error body's message, else the body's start."""
    try:
        error = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message)[:200] if message else repr(raw[:200])


def _choices(event: bytes) -> list[Any]:
    """A streamed event's choices; none for one that is not a JSON object (not a token either)."""
    try:
        data = orjson.loads(event)
    except orjson.JSONDecodeError:
        return []
    choices = data.get("choices") if isinstance(data, dict) else None
    return choices if isinstance(choices, list) else []


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value or 0))
    except ValueError:  # an HTTP date: not what pdserve or vLLM send
        return 0.0


async def send(
    session: aiohttp.ClientSession,
    base: str,
    job: Job,
    timeout: float = 120.0,
    hang_up_after: int | None = None,
) -> Outcome:
    """One request as ``job`` says; never raises for what the server or the network does.
    ``hang_up_after``: a streamed request's client closes the connection after that many chunks."""
    is_stream = bool(job.body.get("stream"))
    headers = {"Content-Type": "application/json", **job.headers}
    begun = time.perf_counter()
    first = last = 0.0
    out = Outcome(ok=False, begun=begun)
    try:
        async with asyncio.timeout(timeout):
            async with session.post(base + job.path, data=orjson.dumps(job.body), headers=headers) as resp:
                out.status = resp.status
                if resp.status != 200:
                    out.retry_after_s = _retry_after(resp.headers.get("Retry-After"))
                    out.error = _error_message(await resp.read())
                    return out
                if not is_stream:
                    raw = await resp.read()
                    try:
                        out.text = text_of(orjson.loads(raw)["choices"][0])
                    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
                        out.error = f"not an answer: {raw[:60]!r}"
                    out.ok = out.error is None
                    return out
                reader = sse.EventReader()
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    for event in reader.feed(chunk):
                        if event == sse.DONE_PAYLOAD:
                            out.ok = out.error is None
                        elif (error := sse.error_of(event)) is not None:
                            out.error = f"stream error event: {error.get('message', error)}"[:200]
                        elif choices := _choices(event):
                            if out.num_chunks == 0:
                                first = now
                            else:
                                out.itls.append(now - last)
                            last = now
                            out.num_chunks += 1
                            out.text += "".join(text_of(c) for c in choices if isinstance(c, dict))
                            if out.num_chunks == hang_up_after:
                                out.is_hung_up = True
                                return out
                if not out.ok and out.error is None:
                    out.error = "stream ended without [DONE]"
    except TimeoutError:
        out.error, out.is_timed_out = f"no end within {timeout:g} s", True
    except (aiohttp.ClientError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
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
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while queue:
                job = queue.pop()
                outcomes.append(
                    await send(session, base, Job(job.path, {**job.body, "stream": True}), timeout)
                )

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
        first_error=failed[0].why if failed else None,
    )
