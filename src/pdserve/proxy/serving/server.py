"""Serving the proxy app: uvicorn on uvloop with httptools, access log and proxy headers off (the proxy is
on every token's path), generation routes dispatched before Starlette (``ProxyApp``), each connection's
writes of one loop turn sent as one (``CorkedTransport``), and client connections held to deadlines and
a cap (``_CorkedHttpToolsProtocol``): a connection that sends nothing, trickles its headers or its body,
or idles between requests is closed, so that idle sockets cannot pile up until file descriptors run out.

``_CorkedHttpToolsProtocol`` subclasses a uvicorn class that is not its public API: pyproject.toml pins
uvicorn's minor release, and tests/proxy/test_server.py names what changed if an upgrade breaks it."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.config import ProxyConfig
from pdserve.configparts import AdmissionLimits
from pdserve.protocol import error_body
from pdserve.proxy.serving.app import ProxyApp, create_app

log = logging.getLogger("pdserve.proxy")


class CorkedTransport:
    """A client connection's transport whose writes within one turn of the loop leave as one send.

    uvicorn writes the status line and headers, then each body message, each with its own send; on
    loopback and in VMs a send costs the receiver's side too, and those sends were a fifth of the
    proxy's CPU (profiled). A whole answer now leaves in one send, a stream's headers with its first
    chunk, its last chunk with the end. The bytes and their order are unchanged; they wait at most
    until the loop's next turn, and flow control sees them then.
    """

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._flush()
        self._transport.set_protocol(protocol)

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, …
        return getattr(self._transport, name)


def _refusal(status: bytes, message: str, extra: bytes = b"") -> bytes:
    """A whole HTTP answer that closes the connection, written before any app saw the request."""
    body = error_body(message, "Request Timeout" if status.startswith(b"408") else "ServiceUnavailable",
                      int(status[:3]))  # fmt: skip
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n" + extra
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip


class ClientDeadlines:
    """When each client connection of one server must have sent what it owes, checked by one sweep.

    A request writes its connection's deadline (a float: no timer per request, which on uvloop cost
    about 5 µs to arm and cancel, twice a request); one timer per server sweeps the open connections
    every quarter of the shorter timeout (at most every second) while any is open, so a connection is
    closed at most that much late."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._interval = min(1.0, max(0.05, min(limits.header_timeout_s, limits.body_timeout_s) / 4))
        self._connections: set[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, loop: asyncio.AbstractEventLoop, connections: set[Any]) -> None:
        """A connection opened on ``loop``; ``connections``: the server's open ones (uvicorn's set)."""
        self._connections = connections
        if self._timer is None:
            self._timer = loop.call_later(self._interval, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        connections = self._connections or set()
        for connection in [c for c in connections if isinstance(c, _CorkedHttpToolsProtocol)]:
            if connection.deadline is not None and connection.deadline <= now:
                connection.expired()
        self._timer = loop.call_later(self._interval, self._sweep, loop) if connections else None


class _CorkedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's protocol with corked writes and client deadlines: a deadline for the headers (from
    connect, then from each request's first byte) and one for the body, cleared once the request is in
    (``ClientDeadlines`` enforces them); between requests uvicorn's own keep-alive timer runs. A
    connection past ``max_connections`` gets a 503 and is closed at once."""

    def __init__(self, *args: Any, deadlines: ClientDeadlines | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadlines = deadlines or ClientDeadlines(AdmissionLimits())
        self._limits = self._deadlines.limits
        self._header_s = self._limits.header_timeout_s  # read on every request: kept at hand
        self._body_s = self._limits.body_timeout_s
        self.deadline: float | None = None  # loop time by which the request under way must be in
        self._is_reading = False  # a request has begun and is not complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, CorkedTransport(transport, self.loop)))
        limit = self._limits.max_connections
        if len(self.connections) > limit:
            message = f"pdserve has {limit} client connections open, its limit; retry later"
            log.warning("client connection refused: %d open, the limit", limit)
            self.transport.write(_refusal(b"503 Service Unavailable", message, b"retry-after: 1\r\n"))
            self.transport.close()
            return
        self.deadline = self.loop.time() + self._header_s
        self._deadlines.watch(self.loop, self.connections)

    # The parser's callbacks, on every request: the base class's called directly (no super() object).
    def on_message_begin(self) -> None:
        HttpToolsProtocol.on_message_begin(self)
        self._is_reading = True
        self.deadline = self.loop.time() + self._header_s

    def on_headers_complete(self) -> None:
        HttpToolsProtocol.on_headers_complete(self)
        if self._is_reading:
            self.deadline = self.loop.time() + self._body_s

    def on_message_complete(self) -> None:
        HttpToolsProtocol.on_message_complete(self)
        self._is_reading = False
        self.deadline = None

    def expired(self) -> None:
        """Too slow: a request that had begun is told so (408), unless an answer is being written."""
        self.deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        is_answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if self._is_reading and not is_answering:
            self.transport.write(_refusal(b"408 Request Timeout", "request not received in time"))
        self.transport.close()


def make_server(config: ProxyConfig, log_level: str = "info", app: Starlette | None = None) -> uvicorn.Server:
    # Each of several workers sharing the port holds its share of the connections (SO_REUSEPORT spreads them).
    limits = config.worker_share().admission if config.workers > 1 else config.admission
    uv_config = uvicorn.Config(
        ProxyApp(app or create_app(config)),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=cast(Any, functools.partial(_CorkedHttpToolsProtocol, deadlines=ClientDeadlines(limits))),
        access_log=False,
        # X-Forwarded-* rewriting of the client address: nothing in the proxy reads that address.
        proxy_headers=False,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        # On shutdown (SIGTERM, Ctrl-C) uvicorn stops accepting, then waits this long for answers in
        # flight before it cancels them: a stream still running after 5 s ends cut short. Unset, it
        # would wait for every stream however long, and a stopping proxy would hang on a slow one.
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(uv_config)


def tune_gc() -> None:
    """For a process that is mostly proxy, once at start. A request allocates dozens of short-lived
    containers, and CPython's default (a young collection every 700 allocations) spent 7 % of the proxy's
    CPU in the collector (py-spy, whole answers at 64 concurrent). The young objects alive at any moment
    are the requests in flight, so a young collection every 50,000 allocations costs about as much as one
    every 700 and happens 70 times less often; what start-up built is frozen out of every collection."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
