"""HTTP/1.1 on raw asyncio: one keep-alive ``Connection`` (an ``asyncio.Protocol`` parsing with httptools)
and the ``Pool`` of them per server. client.py drives both; failures.py is the one place their exceptions
become pdserve's. ``RequestWriter`` writes every request the proxy sends, to an instance or to a sibling
worker (peers.py).

Why not a general client: every token of every stream passes here. A body chunk costs one parser
callback and, when the reader already waits, one future; a gap limit costs no timer per chunk (one lazy
timer per connection re-arms itself only when it fires early). What this speaks is what vLLM speaks:
requests with a known body length, answers with ``content-length``, chunked, or read-until-close bodies.

Raised here, all builtins: ``TimeoutError`` (a wait passed its deadline), ``ConnectionResetError`` (the
connection closed before the answer was complete), ``ConnectionError`` (the answer was not HTTP).
Deadlines are ``loop.time()`` values.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from typing import cast

import httptools

_PAUSE_AT = 256 * 1024  # buffered answer bytes at which reading stops until the reader catches up


class RequestWriter:
    """The bytes of one HTTP/1.1 request to ``host``, head and body together; a body is JSON.

    A header value holding CR or LF is refused (ValueError) before anything is sent: forwarded from a
    client, it would end the header early and add headers, or a whole request, of the client's own.
    """

    __slots__ = ("_host", "_prefix")

    def __init__(self, host: str, path_prefix: str = "") -> None:
        self._host = f"Host: {host}\r\n".encode("latin-1")
        self._prefix = path_prefix

    def __call__(self, method: bytes, path: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
        lines = [method, b" ", (self._prefix + path).encode("latin-1"), b" HTTP/1.1\r\n", self._host]
        if body is not None:
            lines.append(b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
        for name, value in headers.items():
            if "\n" in value or "\r" in value:
                raise ValueError(f"header {name} holds a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        if body is not None:
            lines.append(body)
        return b"".join(lines)


class Connection(asyncio.Protocol):
    """One connection; one request at a time, its answer read as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._error: Exception | None = None
        self._has_length = False  # content-length or chunked: the end is in the bytes, not the close
        self._is_paused = False
        self._keeps_alive = False
        self.status = 0
        self.content_type: str | None = None
        self.has_head = False
        self.is_complete = False
        self.is_closed = False
        self.idle_since = 0.0

    # --- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if self.has_head and not self._has_length and not self.is_complete:
            self.is_complete = True  # a body that ends with the connection
        elif not self.is_complete:
            self._error = ConnectionResetError("connection closed before the answer was complete")
        self._wake()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionError("the instance switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"invalid HTTP answer: {exc}"))

    # --- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self._has_length = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.has_head = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_AT and self._transport is not None and not self._is_paused:
            self._is_paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.is_complete = True
        self._keeps_alive = self._parser.should_keep_alive()  # valid only inside this callback
        self._wake()

    # --- the caller's side ------------------------------------------------------------------------

    def send(self, request: bytes) -> None:
        """Write a whole request; the connection must be idle."""
        assert self._transport is not None
        self._chunks.clear()
        self._buffered = 0
        self.status, self.content_type, self.has_head, self.is_complete = 0, None, False, False
        self._has_length = self._keeps_alive = False
        self._transport.write(request)

    async def head(self, deadline: float) -> None:
        """Until the status line and headers have arrived."""
        while not self.has_head:
            await self._wait(deadline)

    async def read(self, deadline: float) -> bytes:
        """The body bytes that arrived since the last read, waiting for some; b"" at the end."""
        while not self._chunks:
            if self.is_complete:
                return b""
            await self._wait(deadline)
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._is_paused and self._transport is not None:
            self._is_paused = False
            self._transport.resume_reading()
        return data

    @property
    def is_reusable(self) -> bool:
        """The answer was read to its end and both sides keep the connection open."""
        return self.is_complete and not self.is_closed and self._keeps_alive

    def close(self) -> None:
        """Drop the connection (an instance aborts the request it was serving on it)."""
        self.is_closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self._wake()
        self.close()

    async def _wait(self, deadline: float) -> None:
        if self._error is not None:
            raise self._error
        if self.is_closed:
            raise ConnectionResetError("connection closed before the answer was complete")
        waiter = self._waiter = self._loop.create_future()
        self._deadline = deadline
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(deadline, self._on_timer)
        try:
            await waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _on_timer(self) -> None:
        # Fires at the earliest deadline ever set; a later wait may have moved it on: re-arm then.
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._loop.time() >= self._deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Pool:
    """At most ``limit`` connections to one instance; idle ones kept ``keepalive_s``, newest reused first."""

    def __init__(self, limit: int, keepalive_s: float) -> None:
        # Made on the loop that uses it; kept, since each asyncio.get_running_loop() costs a getpid()
        # syscall on CPython 3.11 (3.5 % of the proxy's CPU, profiled).
        self.loop = asyncio.get_running_loop()
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._idle: deque[Connection] = deque()
        self._num_open = 0  # idle, in use, and being opened
        self._waiters: deque[asyncio.Future[Connection | None]] = deque()
        self.is_closed = False

    def take(self) -> Connection | None:
        """An idle connection still fit to reuse, if there is one (no wait: the common case)."""
        now = self.loop.time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.is_closed and now - conn.idle_since < self._keepalive_s:
                return conn
            self._drop(conn)
        return None

    async def acquire(self, deadline: float) -> Connection | None:
        """An idle connection, or None: the caller may open one (and must ``release`` or ``forfeit`` it).
        Callers that tried ``take`` first lose nothing: it is tried again here."""
        if (conn := self.take()) is not None:
            return conn
        if self._num_open < self._limit:
            self._num_open += 1
            return None
        loop = self.loop
        waiter: asyncio.Future[Connection | None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # handed over just as we gave up: pass it on
            raise
        finally:
            timer.cancel()
            if not waiter.done():
                waiter.cancel()

    def forfeit(self) -> None:
        """A slot from ``acquire`` whose connection was never opened."""
        self._num_open -= 1
        self._hand_over(None)

    def release(self, conn: Connection | None) -> None:
        """Back to the pool when reusable, else closed; either way the next waiter gets its turn."""
        if conn is None:
            self.forfeit()
            return
        if self.is_closed or not conn.is_reusable:
            self._drop(conn)
            self._hand_over(None)
            return
        conn.idle_since = self.loop.time()
        if not self._hand_over(conn):
            self._idle.append(conn)
            while self._idle and self._idle[0].is_closed:  # the oldest go first; keep the list short
                self._drop(self._idle.popleft())

    def close(self) -> None:
        self.is_closed = True
        while self._idle:
            self._drop(self._idle.pop())

    def _drop(self, conn: Connection) -> None:
        conn.close()
        self._num_open -= 1

    def _hand_over(self, conn: Connection | None) -> bool:
        """Give ``conn`` (None: a free slot) to the first live waiter; False if there was none."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            if conn is None:
                self._num_open += 1
            waiter.set_result(conn)
            return True
        return False


def _expire(waiter: asyncio.Future[Connection | None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
