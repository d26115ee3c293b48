"""How the proxy talks to one instance: the ``Upstream`` protocol the flow calls, and ``HTTPUpstream``,
its aiohttp implementation with one pooled keep-alive client per instance.

This is the only module that touches aiohttp: every aiohttp and timeout exception is translated here
into an ``UpstreamError`` naming the phase and the instance, so the flow reads as success-or-error.
Tests give the flow an in-memory ``Upstream`` instead (tests/proxy/memory_upstream.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from pdserve.config import Role
from pdserve.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout, UpstreamUnavailable

_JSON_HEADERS = {"Content-Type": "application/json"}
_KEEPALIVE_S = 4.0
# Failures of a reused connection that the server had already closed: the request never reached it.
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


@dataclass(frozen=True)
class Reply:
    """A complete upstream answer (non-streamed)."""

    status: int
    content_type: str
    body: bytes


class Stream(Protocol):
    """An open upstream response whose body is read chunk by chunk under per-gap time limits."""

    @property
    def status(self) -> int: ...
    @property
    def content_type(self) -> str: ...
    async def read_all(self, timeout: float) -> bytes: ...
    def chunks(
        self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
    ) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; the first may take ``first_timeout``, later gaps ``idle_timeout``.

        ``first_budget`` is the configured limit the first chunk's wait is part of (``first_timeout`` may
        be what is left of it): errors quote the limit the user set, not the remainder.
        """
        ...


class Upstream(Protocol):
    """An instance as the flow, health checks and admin API call it."""

    @property
    def role(self) -> Role: ...
    @property
    def url(self) -> str: ...
    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        phase: str,
        timeout: float,
        is_repeatable: bool = False,
    ) -> Reply:
        """POST and read the whole answer within ``timeout`` seconds. ``is_repeatable``: the request
        may be sent again on a fresh connection when a kept-alive one turns out closed."""
        ...

    def open_stream(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> AbstractAsyncContextManager[Stream]:
        """POST and yield once the status line arrives (within ``timeout``); the body is read lazily.

        Leaving the block closes the connection, which makes vLLM abort the request and free its KV.
        """
        ...

    async def get(self, path: str, phase: str, timeout: float) -> Reply: ...


class _HTTPStream:
    def __init__(self, upstream: HTTPUpstream, phase: str, resp: aiohttp.ClientResponse) -> None:
        self._upstream = upstream
        self._phase = phase
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")

    async def read_all(self, timeout: float) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._upstream.translate(self._phase, exc, timeout) from exc

    async def chunks(
        self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
    ) -> AsyncIterator[bytes]:
        content = self._resp.content
        limit, quoted = first_timeout, first_budget if first_budget is not None else first_timeout
        while True:
            try:
                async with asyncio.timeout(limit):
                    chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise self._upstream.translate(self._phase, exc, quoted) from exc
            if not chunk:
                return
            yield chunk
            limit = quoted = idle_timeout


class HTTPUpstream:
    """``Upstream`` over HTTP: one keep-alive connection pool per instance."""

    def __init__(self, role: Role, url: str, connect_timeout: float, max_connections: int) -> None:
        self.role = role
        self.url = url
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            ttl_dns_cache=300,
            enable_cleanup_closed=True,
            # Below vLLM's own keep-alive (uvicorn's 5 s): a connection the server is about to close is
            # never reused, so a request is not lost to a stale one.
            keepalive_timeout=_KEEPALIVE_S,
        )
        self._session = aiohttp.ClientSession(
            base_url=self.url,
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
            auto_decompress=False,
            # No Accept-Encoding: bodies are relayed as received, and a compressed one would reach
            # clients without its Content-Encoding.
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"upstream {self.url} used before open()")
        return self._session

    def translate(self, phase: str, exc: BaseException, limit: float | None = None) -> UpstreamError:
        """The one place where aiohttp's and asyncio's exceptions become pdserve's."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):  # the TCP connect itself (sock_connect)
            detail = f"cannot connect within {self._connect_timeout:g} s"
            return UpstreamConnectError(phase, self.url, detail, is_slow=True)
        if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
            shown = self._connect_timeout if limit is None else limit
            return UpstreamTimeout(phase, self.url, f"no answer within {shown:g} s")
        if isinstance(exc, aiohttp.ClientConnectorError):
            return UpstreamConnectError(phase, self.url, f"cannot connect ({exc.os_error})")
        if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
            return UpstreamUnavailable(phase, self.url, "connection closed before the answer was complete")
        return UpstreamUnavailable(phase, self.url, f"{type(exc).__name__}: {exc}")

    async def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        phase: str,
        timeout: float,
        is_repeatable: bool = False,
    ) -> Reply:
        all_headers = {**_JSON_HEADERS, **headers}
        try:
            async with asyncio.timeout(timeout):
                for attempt in (1, 2):
                    try:
                        async with self._client.post(path, data=body, headers=all_headers) as resp:
                            payload = await resp.read()
                            content_type = resp.headers.get("Content-Type", "application/json")
                            return Reply(resp.status, content_type, payload)
                    except _STALE as exc:
                        # Once more on a fresh connection, invisibly, when sending twice is harmless.
                        if not is_repeatable or attempt == 2 or isinstance(exc, aiohttp.ClientConnectorError):
                            raise
                raise AssertionError("unreachable")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.translate(phase, exc, timeout) from exc

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> AsyncIterator[Stream]:
        try:
            async with asyncio.timeout(timeout):
                resp = await self._client.post(path, data=body, headers={**_JSON_HEADERS, **headers})
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.translate(phase, exc, timeout) from exc
        try:
            yield _HTTPStream(self, phase, resp)
        finally:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        try:
            async with asyncio.timeout(timeout):
                for attempt in (1, 2):
                    try:
                        async with self._client.get(path) as resp:
                            payload = await resp.read()
                            return Reply(resp.status, resp.headers.get("Content-Type", "text/plain"), payload)
                    except _STALE as exc:
                        if attempt == 2 or isinstance(exc, aiohttp.ClientConnectorError):
                            raise
                raise AssertionError("unreachable")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.translate(phase, exc, timeout) from exc
