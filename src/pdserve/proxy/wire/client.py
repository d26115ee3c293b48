"""The proxy's one HTTP client: ``Client``, pooled keep-alive HTTP/1.1 to one server, over TCP (an
instance; upstream.py makes it one) or a Unix socket (a sibling worker of a multi-process proxy,
serving/peers.py).

It drives connection.py's ``Connection`` and ``Pool``; whatever goes wrong underneath leaves as the
``UpstreamError`` failures.py's ``failure`` makes of it, at each call's one ``except OSError``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from pdserve.proxy.wire.connection import Connection, Pool, RequestWriter
from pdserve.proxy.wire.failures import failure

# Idle connections are kept below vLLM's own keep-alive (uvicorn's 5 s): a connection the server is about
# to close is never reused, so a request is not lost to a stale one.
_KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class Reply:
    """A complete answer (non-streamed)."""

    status: int
    content_type: str
    body: bytes


@dataclass(frozen=True)
class Address:
    """Where a server listens: ``host``:``port`` over TCP (TLS with ``tls``), or the Unix socket ``path``."""

    host: str = ""
    port: int = 0
    tls: ssl.SSLContext | None = None
    path: str | None = None


class _HTTPStream:
    """An answer whose body is read as it comes (upstream.py's ``Stream``)."""

    def __init__(self, client: Client, phase: str, conn: Connection) -> None:
        self._client = client
        self._phase = phase
        self._conn = conn
        self.status = conn.status
        self.content_type = conn.content_type or "application/json"

    async def read_all(self, timeout: float) -> bytes:
        conn, deadline = self._conn, self._client.loop.time() + timeout
        parts = []
        try:
            while chunk := await conn.read(deadline):
                parts.append(chunk)
        except OSError as exc:
            raise failure(exc, self._client, self._phase, timeout) from exc
        return b"".join(parts)

    async def chunks(
        self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
    ) -> AsyncIterator[bytes]:
        conn, loop = self._conn, self._client.loop
        limit, quoted = first_timeout, first_budget if first_budget is not None else first_timeout
        while True:
            try:
                chunk = await conn.read(loop.time() + limit)
            except OSError as exc:
                raise failure(exc, self._client, self._phase, quoted) from exc
            if not chunk:
                return
            yield chunk
            limit = quoted = idle_timeout


class Client:
    """At most ``max_connections`` keep-alive connections to the server at ``address``, named ``url`` in
    errors; a new connection may take ``connect_timeout``. ``open`` it on the loop that will use it."""

    def __init__(
        self, url: str, address: Address, request: RequestWriter, connect_timeout: float, max_connections: int
    ) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self._address = address
        self._request = request
        self._max_connections = max_connections
        self._pool: Pool | None = None

    async def open(self) -> None:
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
            raise RuntimeError(f"client of {self.url} used before open()")
        return self._pool

    def post(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float,
        is_repeatable: bool = False,
    ) -> Coroutine[Any, Any, Reply]:  # fmt: skip
        """POST and read the whole answer within ``timeout`` seconds. ``is_repeatable``: the request may
        be sent again on a fresh connection when a kept-alive one turns out closed."""
        # exchange's coroutine itself, not one awaiting it: a frame fewer on both calls of each request.
        # The request is written here, so a header that would split it raises at the call, unsent.
        return self.exchange(self._request(b"POST", path, headers, body), phase, timeout, is_repeatable)

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        return await self.exchange(self._request(b"GET", path, {}, None), phase, timeout, is_repeatable=True)

    async def exchange(
        self, request: bytes, phase: str, timeout: float, is_repeatable: bool = False
    ) -> Reply:
        """Send a whole request (connection.py's ``RequestWriter`` wrote it) and read the whole answer."""
        pool = self._connections
        deadline = pool.loop.time() + timeout
        try:
            while True:
                conn = reused = pool.take()  # an idle one at once, no coroutine: most calls
                if conn is None:
                    conn, reused = await self._connection(phase, timeout, deadline)
                try:
                    conn.send(request)
                    await conn.head(deadline)
                    parts = []
                    while chunk := await conn.read(deadline):
                        parts.append(chunk)
                    return Reply(conn.status, conn.content_type or "application/json", b"".join(parts))
                except ConnectionResetError:
                    if is_repeatable and conn is reused and not conn.has_head:
                        # A kept-alive connection the server had closed: the request never reached it.
                        continue  # once more on a fresh one, invisibly, as sending twice is harmless
                    raise
                finally:
                    if not conn.is_complete:
                        conn.close()
                    pool.release(conn)
        except OSError as exc:
            raise failure(exc, self, phase, timeout, reused) from exc

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> AsyncIterator[_HTTPStream]:
        """POST and yield once the status line arrives (within ``timeout``); the body is read lazily.

        Leaving the block closes the connection unless the answer was read to its end: vLLM then aborts
        the request and frees its KV."""
        request = self._request(b"POST", path, headers, body)
        pool = self._connections
        deadline = pool.loop.time() + timeout
        try:
            conn = reused = pool.take()
            if conn is None:
                conn, reused = await self._connection(phase, timeout, deadline)
            try:
                conn.send(request)
                await conn.head(deadline)
            except BaseException:
                conn.close()
                pool.release(conn)
                raise
        except OSError as exc:
            raise failure(exc, self, phase, timeout, reused) from exc
        try:
            yield _HTTPStream(self, phase, conn)
        finally:
            if not conn.is_complete:
                conn.close()
            pool.release(conn)

    async def _connection(
        self, phase: str, limit: float, deadline: float
    ) -> tuple[Connection, Connection | None]:
        """A pooled connection once one is free, or a new one; with the connection it is if it was kept
        alive (None: new). Waiting for a free one is not connecting: its timeout is the call's."""
        pool = self._connections
        conn = await pool.acquire(deadline)
        if conn is not None:
            return conn, conn
        loop, address = pool.loop, self._address
        connect_limit = min(self.connect_timeout, deadline - loop.time())
        try:
            async with asyncio.timeout(connect_limit):
                if address.path is not None:
                    _, conn = await loop.create_unix_connection(lambda: Connection(loop), address.path)
                else:
                    _, conn = await loop.create_connection(
                        lambda: Connection(loop), address.host, address.port, ssl=address.tls
                    )
        except BaseException as exc:
            pool.forfeit()
            if isinstance(exc, OSError):
                raise failure(exc, self, phase, limit, connecting=connect_limit) from exc
            raise
        return conn, None
