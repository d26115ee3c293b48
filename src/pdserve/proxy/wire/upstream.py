"""How the proxy talks to one instance: the ``Upstream`` protocol the flow calls, and ``HTTPUpstream``,
its HTTP/1.1 implementation with one pool of keep-alive connections per instance (connection.py).

This is the only module where failures of those connections (asyncio's and the OS's exceptions, and
connection.py's, all builtins) become an ``UpstreamError`` naming the phase and the instance, so the flow
reads as success-or-error. Tests give the flow an in-memory ``Upstream`` instead
(tests/proxy/memory_upstream.py).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from pdserve.config import Role
from pdserve.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamStaleConnection,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pdserve.proxy.wire.connection import Connection, Pool, RequestWriter

_KEEPALIVE_S = 4.0


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
    def __init__(self, upstream: HTTPUpstream, phase: str, conn: Connection) -> None:
        self._upstream = upstream
        self._phase = phase
        self._conn = conn
        self.status = conn.status
        self.content_type = conn.content_type or "application/json"

    async def read_all(self, timeout: float) -> bytes:
        conn, deadline = self._conn, self._upstream.loop.time() + timeout
        parts = []
        try:
            while chunk := await conn.read(deadline):
                parts.append(chunk)
        except (OSError, TimeoutError) as exc:
            raise self._upstream.translate(self._phase, exc, timeout) from exc
        return b"".join(parts)

    async def chunks(
        self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
    ) -> AsyncIterator[bytes]:
        conn, loop = self._conn, self._upstream.loop
        limit, quoted = first_timeout, first_budget if first_budget is not None else first_timeout
        while True:
            try:
                chunk = await conn.read(loop.time() + limit)
            except (OSError, TimeoutError) as exc:
                raise self._upstream.translate(self._phase, exc, quoted) from exc
            if not chunk:
                return
            yield chunk
            limit = quoted = idle_timeout


class HTTPUpstream:
    """``Upstream`` over HTTP/1.1: one pool of keep-alive connections per instance."""

    def __init__(self, role: Role, url: str, connect_timeout: float, max_connections: int) -> None:
        self.role = role
        self.url = url
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"instance URL must be http(s)://host[:port], got {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._request = RequestWriter(parts.netloc, parts.path.rstrip("/"))
        self._pool: Pool | None = None

    async def open(self) -> None:
        # Idle connections are kept below vLLM's own keep-alive (uvicorn's 5 s): a connection the
        # server is about to close is never reused, so a request is not lost to a stale one.
        self._pool = Pool(self._max_connections, _KEEPALIVE_S)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the pool lives on (asyncio.get_running_loop() costs a getpid() syscall each time)."""
        return self._connections.loop

    @property
    def _connections(self) -> Pool:
        if self._pool is None:
            raise RuntimeError(f"upstream {self.url} used before open()")
        return self._pool

    def translate(self, phase: str, exc: BaseException, limit: float | None = None) -> UpstreamError:
        """The one place where connection, OS and timeout exceptions become pdserve's."""
        if isinstance(exc, TimeoutError):
            shown = self._connect_timeout if limit is None else limit
            return UpstreamTimeout(phase, self.url, f"no answer within {shown:g} s")
        if isinstance(exc, ConnectionResetError | BrokenPipeError):
            return UpstreamUnavailable(phase, self.url, "connection closed before the answer was complete")
        return UpstreamUnavailable(phase, self.url, f"{type(exc).__name__}: {exc}")

    def _stale(self, phase: str) -> UpstreamStaleConnection:
        return UpstreamStaleConnection(
            phase, self.url, "connection closed before the answer was complete (a kept-alive one)"
        )

    async def _connection(self, phase: str, deadline: float) -> tuple[Connection, bool]:
        """A pooled connection (True: reused) or a new one; waiting for a free one is not connecting."""
        pool = self._connections
        conn = await pool.acquire(deadline)
        if conn is not None:
            return conn, True
        loop = self.loop
        limit = min(self._connect_timeout, deadline - loop.time())
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError:
            pool.forfeit()
            if limit < self._connect_timeout:
                raise  # the call's own limit ran out first
            detail = f"cannot connect within {self._connect_timeout:g} s"
            raise UpstreamConnectError(phase, self.url, detail, is_slow=True) from None
        except OSError as exc:
            pool.forfeit()
            raise UpstreamConnectError(phase, self.url, f"cannot connect ({exc})") from exc
        except BaseException:
            pool.forfeit()
            raise
        return conn, False

    async def _call(
        self, method: bytes, path: str, headers: Mapping[str, str], body: bytes | None, phase: str,
        timeout: float, is_repeatable: bool,
    ) -> Reply:  # fmt: skip
        request = self._request(method, path, headers, body)
        deadline = self.loop.time() + timeout
        try:
            while True:
                conn, is_reused = await self._connection(phase, deadline)
                try:
                    conn.send(request)
                    await conn.head(deadline)
                    parts = []
                    while chunk := await conn.read(deadline):
                        parts.append(chunk)
                except ConnectionResetError as exc:
                    self._connections.release(conn)
                    if is_reused and not conn.has_head:
                        # A kept-alive connection the instance had closed: the request never reached
                        # it. Once more on a fresh one, invisibly, when sending twice is harmless.
                        if is_repeatable:
                            continue
                        raise self._stale(phase) from exc
                    raise
                except BaseException:
                    conn.close()
                    self._connections.release(conn)
                    raise
                self._connections.release(conn)
                return Reply(conn.status, conn.content_type or "application/json", b"".join(parts))
        except (OSError, TimeoutError) as exc:
            raise self.translate(phase, exc, timeout) from exc

    def post(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float,
        is_repeatable: bool = False,
    ) -> Coroutine[Any, Any, Reply]:  # fmt: skip
        # _call's coroutine itself, not one awaiting it: a frame fewer on both calls of each request
        return self._call(b"POST", path, headers, body, phase, timeout, is_repeatable)

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> AsyncIterator[Stream]:
        request = self._request(b"POST", path, headers, body)
        deadline = self.loop.time() + timeout
        pool = self._connections
        try:
            conn, is_reused = await self._connection(phase, deadline)
        except (OSError, TimeoutError) as exc:
            raise self.translate(phase, exc, timeout) from exc
        try:
            try:
                conn.send(request)
                await conn.head(deadline)
            except ConnectionResetError as exc:
                raise (self._stale(phase) if is_reused else self.translate(phase, exc, timeout)) from exc
            except (OSError, TimeoutError) as exc:
                raise self.translate(phase, exc, timeout) from exc
            yield _HTTPStream(self, phase, conn)
        finally:
            if not conn.is_complete:
                conn.close()  # the instance aborts the request and frees its KV
            pool.release(conn)

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        return await self._call(b"GET", path, {}, None, phase, timeout, is_repeatable=True)
