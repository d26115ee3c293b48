"""The proxy's one HTTP client: ``Client``, pooled keep-alive HTTP/1.1 to one server, over TCP (an
instance; upstream.py makes it one) or a Unix socket (a sibling worker of a multi-process proxy,
serving/peers.py).

It drives connection.py's ``Connection`` and ``Pool``; whatever goes wrong underneath leaves through
failures.py's ``Failures`` block as an ``UpstreamError``, and only there.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from pdserve.proxy.wire.connection import Connection, Pool, RequestWriter
from pdserve.proxy.wire.failures import Failures

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
        with Failures(self._client, self._phase, timeout):
            while chunk := await conn.read(deadline):
                parts.append(chunk)
        return b"".join(parts)

    async def chunks(
        self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
    ) -> AsyncIterator[bytes]:
        conn, loop = self._conn, self._client.loop
        limit, quoted = first_timeout, first_budget if first_budget is not None else first_timeout
        # The block spans the yields: the consumer's own errors never come back in through them
        # (``async for`` throws nothing into its generator), only its closing and cancelling, which pass.
        with Failures(self._client, self._phase, quoted) as failures:
            while chunk := await conn.read(loop.time() + limit):
                yield chunk
                limit = failures.limit = idle_timeout


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
        # exchange's coroutine itself, not one awaiting it: a frame fewer on both calls of each request
        return self.exchange(self._request(b"POST", path, headers, body), phase, timeout, is_repeatable)

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        return await self.exchange(self._request(b"GET", path, {}, None), phase, timeout, is_repeatable=True)

    async def exchange(
        self, request: bytes, phase: str, timeout: float, is_repeatable: bool = False
    ) -> Reply:
        """Send a whole request (connection.py's ``RequestWriter`` wrote it) and read the whole answer."""
        pool = self._connections
        deadline = pool.loop.time() + timeout
        with Failures(self, phase, timeout) as failures:
            while True:
                conn = await self._connection(failures, deadline)
                try:
                    conn.send(request)
                    await conn.head(deadline)
                    parts = []
                    while chunk := await conn.read(deadline):
                        parts.append(chunk)
                    return Reply(conn.status, conn.content_type or "application/json", b"".join(parts))
                except ConnectionResetError:
                    if is_repeatable and failures.is_stale(conn):
                        continue  # once more on a fresh connection, invisibly
                    raise
                finally:
                    if not conn.is_complete:
                        conn.close()
                    pool.release(conn)

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
        with Failures(self, phase, timeout) as failures:
            conn = await self._connection(failures, deadline)
            try:
                conn.send(request)
                await conn.head(deadline)
            except BaseException:
                conn.close()
                pool.release(conn)
                raise
        try:
            yield _HTTPStream(self, phase, conn)
        finally:
            if not conn.is_complete:
                conn.close()
            pool.release(conn)

    async def _connection(self, failures: Failures, deadline: float) -> Connection:
        """A pooled connection or a new one; waiting for a free one is not connecting."""
        pool = self._connections
        conn = failures.reused = await pool.acquire(deadline)
        if conn is not None:
            return conn
        loop, address = pool.loop, self._address
        limit = failures.connecting = min(self.connect_timeout, deadline - loop.time())
        try:
            async with asyncio.timeout(limit):
                if address.path is not None:
                    _, conn = await loop.create_unix_connection(lambda: Connection(loop), address.path)
                else:
                    _, conn = await loop.create_connection(
                        lambda: Connection(loop), address.host, address.port, ssl=address.tls
                    )
        except BaseException:
            pool.forfeit()
            raise
        failures.connecting = None
        return conn
