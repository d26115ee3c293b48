"""Simulated instances behind the real proxy, and a client that judges every answer it gets.

For test_fault_matrix.py: two prefill and two decode sim instances in one thread (``sim_pd``), their
faults and engine counters over their HTTP API (``POST /sim/faults``, ``GET /sim/stats``), and ``ask``,
which sends one request and sorts the answer into one of:

    ok            200 and whole: [DONE] (streamed), finish_reason "length", max_tokens tokens, usage agrees
    error         status >= 400 with an OpenAI-style JSON error
    stream_error  200, then an SSE error event
    truncated     anything else: a short answer, a stream that stops without [DONE], a body cut off
    hang          no end within the client's limit

The sim never stops early (no EOS, no stop strings here), so a whole answer has exactly max_tokens tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from pdserve.protocol import Endpoint
from pdserve.sim.faults import FaultSpec
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import load_profile

MODEL = "sim-model"
LEASE_S = 3.0  # prefill holds un-pulled KV this long; the proxy is told the same
# A small step time, so a long generation really runs for a while (zero cost finishes it at once and
# an abort could not be told from the end of the request).
STEP_S = 0.005
PROFILE = dataclasses.replace(
    load_profile("zero"), name="fault-matrix", kv_lease_s=LEASE_S, step_base_s=STEP_S
)
PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
NO_FAULTS = FaultSpec().to_mapping()

Kind = Literal["ok", "error", "stream_error", "truncated", "hang"]


@dataclass(frozen=True)
class SimPD:
    prefill: tuple[str, ...]  # base URLs
    decode: tuple[str, ...]

    @property
    def urls(self) -> tuple[str, ...]:
        return (*self.prefill, *self.decode)


@contextmanager
def sim_pd(num_prefill: int = 2, num_decode: int = 2) -> Iterator[SimPD]:
    specs = [SimInstanceSpec("prefill")] * num_prefill + [SimInstanceSpec("decode")] * num_decode
    with sim_in_thread(specs, PROFILE) as cluster:
        urls = tuple(cluster.urls)
        yield SimPD(urls[:num_prefill], urls[num_prefill:])


# --- The sims' own API ----------------------------------------------------------------------------


async def set_faults(http: aiohttp.ClientSession, url: str, **changes: Any) -> None:
    async with http.post(f"{url}/sim/faults", json=changes) as resp:
        assert resp.status == 200, await resp.text()


async def stall(http: aiohttp.ClientSession, url: str, seconds: float) -> None:
    """The instance's engine stops stepping for ``seconds`` (SIGSTOP of vLLM's EngineCore)."""
    async with http.post(f"{url}/sim/stall", json={"seconds": seconds}) as resp:
        assert resp.status == 200, await resp.text()


async def restart(http: aiohttp.ClientSession, url: str, down_s: float) -> str:
    """The instance dies now and serves again after ``down_s`` under a new engine id (returned)."""
    async with http.post(f"{url}/sim/restart", json={"down_s": down_s}) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["new_engine_id"])


async def clear_faults(http: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    await asyncio.gather(*(set_faults(http, url, **NO_FAULTS) for url in urls))


async def engine_stats(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/sim/stats") as resp:
        assert resp.status == 200, await resp.text()
        return dict((await resp.json())["stats"])


async def all_stats(http: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(engine_stats(http, url) for url in urls)))


async def total(http: aiohttp.ClientSession, urls: Sequence[str], counter: str) -> float:
    return sum(s[counter] for s in await all_stats(http, urls))


async def wait_until(
    check: Callable[[], Awaitable[str | None]], limit_s: float, poll_s: float = 0.05
) -> float:
    """Poll ``check`` (None: satisfied, else what is still wrong) until satisfied; the seconds it took.

    AssertionError with the last complaint when ``limit_s`` runs out."""
    begun = time.monotonic()
    while True:
        complaint = await check()
        elapsed = time.monotonic() - begun
        if complaint is None:
            return elapsed
        if elapsed > limit_s:
            raise AssertionError(f"still after {elapsed:.1f} s: {complaint}")
        await asyncio.sleep(poll_s)


async def settled(http: aiohttp.ClientSession, sims: SimPD, limit_s: float) -> float:
    """Seconds until no prefill holds KV and no engine runs or queues a request; AssertionError after
    ``limit_s``."""

    async def busy() -> str | None:
        stats = dict(zip(sims.urls, await all_stats(http, sims.urls), strict=True))
        busy = {
            url: {k: s[k] for k in ("num_held", "num_running", "num_waiting") if s[k]}
            for url, s in stats.items()
        }
        busy = {url: counts for url, counts in busy.items() if counts}
        return f"engines busy: {busy}" if busy else None

    return await wait_until(busy, limit_s)


# --- The client -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    request_id: str
    endpoint: Endpoint
    stream: bool
    kind: Kind
    status: int  # 0 when no status line arrived
    elapsed_s: float
    detail: str  # the error's message, or why the answer is not whole
    num_tokens: int = 0
    # Streamed: seconds between the error event and the event before it (0 if it came first).
    error_gap_s: float = 0.0
    text: str = ""  # the answer's text (a stream's, as far as it went)

    @property
    def mode(self) -> str:
        return f"{self.endpoint}/{'streamed' if self.stream else 'whole'}"


def request_body(endpoint: Endpoint, stream: bool, max_tokens: int, words: str) -> dict[str, Any]:
    prompt = f"{words} the quick brown fox jumps over the lazy dog and keeps on running through the field"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
    if endpoint == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _text(endpoint: Endpoint, choice: dict[str, Any], stream: bool) -> str:
    if endpoint == "completions":
        return str(choice.get("text") or "")
    part = choice.get("delta" if stream else "message") or {}
    return str(part.get("content") or "")


def _error_message(data: Any) -> str | None:
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else None


def _whole_text(endpoint: Endpoint, payload: bytes) -> str:
    try:
        choices = orjson.loads(payload).get("choices") or [{}]
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    return _text(endpoint, choices[0], stream=False)


def _judge_whole(endpoint: Endpoint, status: int, payload: bytes, max_tokens: int) -> tuple[Kind, str, int]:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "truncated", f"{status} with a body that is not JSON: {payload[:120]!r}", 0
    if status >= 400:
        message = _error_message(data)
        return ("error", message, 0) if message else ("truncated", f"{status} without an error message", 0)
    if status != 200:
        return "truncated", f"unexpected status {status}", 0
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices:
        return "truncated", f"200 without choices: {payload[:120]!r}", 0
    choice = choices[0]
    num_tokens = len(_text(endpoint, choice, stream=False).split())
    usage = data.get("usage") or {}
    if (num_tokens, usage.get("completion_tokens"), choice.get("finish_reason")) != (
        max_tokens,
        max_tokens,
        "length",
    ):
        return (
            "truncated",
            f"{num_tokens} tokens, usage {usage}, finish {choice.get('finish_reason')}",
            num_tokens,
        )
    return "ok", "", num_tokens


@dataclass
class _Stream:
    """What a streamed answer has shown so far."""

    endpoint: Endpoint
    text: str = ""
    finish_reason: str | None = None
    usage_tokens: int | None = None
    error: str | None = None
    error_gap_s: float = 0.0
    is_done: bool = False
    problem: str | None = None  # malformed framing or an event after [DONE]
    last_event_at: float | None = None

    def add(self, block: bytes, now: float) -> None:
        if not block.startswith(b"data: "):
            self.problem = self.problem or f"not an SSE data event: {block[:80]!r}"
            return
        data = block[len(b"data: ") :]
        if self.is_done:
            self.problem = self.problem or f"event after [DONE]: {data[:80]!r}"
        if data == b"[DONE]":
            self.is_done = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.problem = self.problem or f"event is not JSON: {data[:80]!r}"
            return
        message = _error_message(event)
        if message is not None and self.error is None:
            self.error = message
            self.error_gap_s = now - self.last_event_at if self.last_event_at is not None else 0.0
        for choice in event.get("choices") or []:
            self.text += _text(self.endpoint, choice, stream=True)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens")
        self.last_event_at = now

    def judge(self, max_tokens: int, leftover: bytes) -> tuple[Kind, str, int]:
        num_tokens = len(self.text.split())
        if self.error is not None:
            return "stream_error", self.error, num_tokens
        if self.problem is not None:
            return "truncated", self.problem, num_tokens
        if leftover.strip():
            return "truncated", f"stream ends inside an event: {leftover[:80]!r}", num_tokens
        if not self.is_done:
            return "truncated", f"stream ends without [DONE] after {num_tokens} tokens", num_tokens
        if (num_tokens, self.usage_tokens, self.finish_reason) != (max_tokens, max_tokens, "length"):
            detail = f"{num_tokens} tokens, usage {self.usage_tokens}, finish {self.finish_reason}"
            return "truncated", detail, num_tokens
        return "ok", "", num_tokens


async def ask(
    http: aiohttp.ClientSession,
    proxy_url: str,
    endpoint: Endpoint,
    stream: bool,
    request_id: str,
    max_tokens: int,
    limit_s: float,
    words: str | None = None,
) -> Answer:
    """Send one request through the proxy and judge the answer; gives up (kind "hang") after ``limit_s``.
    Its prompt starts with ``words`` (default: the request id, so that every prompt is new)."""
    body = request_body(
        endpoint, stream, max_tokens, request_id if words is None else f"{request_id} {words}"
    )
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    status = 0
    begun = time.monotonic()

    def answer(
        kind: Kind, detail: str, num_tokens: int = 0, error_gap_s: float = 0.0, text: str = ""
    ) -> Answer:
        elapsed = time.monotonic() - begun
        return Answer(
            request_id, endpoint, stream, kind, status, elapsed, detail, num_tokens, error_gap_s, text
        )

    seen = _Stream(endpoint)
    buffer = b""
    try:
        async with asyncio.timeout(limit_s):
            async with http.post(
                proxy_url + PATHS[endpoint], data=orjson.dumps(body), headers=headers
            ) as resp:
                status = resp.status
                is_sse = resp.headers.get("Content-Type", "").startswith("text/event-stream")
                if not (stream and status == 200 and is_sse):
                    payload = await resp.read()
                    judged = _judge_whole(endpoint, status, payload, max_tokens)
                    return answer(*judged, text=_whole_text(endpoint, payload))
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        block, buffer = buffer.split(b"\n\n", 1)
                        seen.add(block, time.monotonic())
    except TimeoutError:
        return answer("hang", f"no end within {limit_s:g} s ({len(seen.text.split())} tokens so far)")
    except aiohttp.ClientPayloadError as exc:
        return answer("truncated", f"connection closed mid-answer: {exc}", len(seen.text.split()))
    kind, detail, num_tokens = seen.judge(max_tokens, buffer)
    return answer(kind, detail, num_tokens, seen.error_gap_s, seen.text)


async def proxy_ready(http: aiohttp.ClientSession, url: str) -> None:
    """Return once the proxy serves (its start checks every instance's model), so a request's time
    is the request's own."""
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200, await resp.text()


async def seen_unhealthy(
    http: aiohttp.ClientSession, proxy_url: str, instance_url: str, limit_s: float
) -> Any:
    """The proxy's /instances once its health checks have found ``instance_url`` unhealthy (reads of
    /instances never check on their own)."""
    listing: Any = None

    async def check() -> str | None:
        nonlocal listing
        listing = await proxy_json(http, proxy_url + "/instances")
        if any(i["url"] == instance_url and not i["healthy"] for i in listing):
            return None
        return f"{instance_url} still healthy in {listing}"

    await wait_until(check, limit_s)
    return listing


async def proxy_json(http: aiohttp.ClientSession, url: str, admin_key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    async with http.get(url, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()
