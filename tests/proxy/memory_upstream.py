"""An in-memory ``Upstream``: the flow runs against scripted instances, no sockets, no event-loop threads.

Each instance is a function from the request body to an ``Answer``; it may raise an ``UpstreamError``
(as HTTPUpstream would after translating aiohttp's). Every call is recorded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from asgi_rig import Recorder as Recorder  # re-exported: the flow tests import it from here
from pdserve.config import Role
from pdserve.errors import UpstreamTimeout
from pdserve.proxy.wire.upstream import Reply, Stream


@dataclass(frozen=True)
class Answer:
    status: int = 200
    body: bytes = b"{}"  # a whole answer
    chunks: Sequence[bytes] = ()  # a streamed one
    content_type: str = "application/json"
    delay_s: float = 0.0  # before the status line: a queued or stalled engine
    before_chunk: Callable[[int], None] | None = None  # called with each chunk's index as it goes out


Script = Callable[[dict[str, Any]], Answer]


@dataclass
class Call:
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]


class _Stream:
    def __init__(self, answer: Answer) -> None:
        self.status = answer.status
        self.content_type = answer.content_type
        self._answer = answer

    async def read_all(self, timeout: float) -> bytes:
        return self._answer.body

    async def chunks(
        self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
    ) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self._answer.chunks):
            if self._answer.before_chunk is not None:
                self._answer.before_chunk(i)
            yield chunk


@dataclass
class MemoryUpstream:
    role: Role
    url: str
    script: Script
    calls: list[Call] = field(default_factory=list)
    metrics: str = ""  # what GET /metrics answers (Prometheus text)
    num_prefix_resets: int = 0  # POST /reset_prefix_cache (the lease guard's purge), answered success

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        if path == "/metrics":
            return Reply(200, "text/plain", self.metrics.encode())
        return Reply(200, "application/json", b"{}")

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float,
        is_repeatable: bool = False,
    ) -> Reply:  # fmt: skip
        if path.startswith("/reset_prefix_cache"):
            self.num_prefix_resets += 1
            return Reply(200, "application/json", b'{"success":true}')
        answer = await self._answer(path, body, headers, phase, timeout)
        return Reply(answer.status, answer.content_type, answer.body)

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> AsyncIterator[Stream]:
        yield _Stream(await self._answer(path, body, headers, phase, timeout))

    async def _answer(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> Answer:
        parsed = orjson.loads(body)
        self.calls.append(Call(path, parsed, dict(headers)))
        answer = self.script(parsed)
        if answer.delay_s > timeout:
            await asyncio.sleep(timeout)
            raise UpstreamTimeout(phase, self.url, f"no answer within {timeout:g} s")
        await asyncio.sleep(answer.delay_s)
        return answer
