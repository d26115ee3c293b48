"""The one place where what the proxy's HTTP client meets underneath becomes pdserve's errors.

Everything client.py does with a connection (wait for a pooled one, connect, send, read the head, read
the body) runs inside a ``Failures`` block, as httpx's transport runs inside ``map_httpcore_exceptions()``.
Underneath are the OS's socket errors, asyncio's ``TimeoutError`` (a deadline of connection.py or
``asyncio.timeout``), and connection.py's own: ``ConnectionResetError`` for a connection that closed
before the answer was complete, ``ConnectionError`` for an answer httptools could not parse. All of them
are ``OSError`` (``TimeoutError`` is one since Python 3.10); each leaves the block as an ``UpstreamError``
naming the phase, the server and what went wrong. Anything else passes untouched: cancellation, the
``ValueError`` of a header that would split the request, pdserve's own errors.

What went wrong depends on how far the call got, which the caller notes on the block as it goes:
``connecting`` (the limit of a connection attempt under way) and ``reused`` (the kept-alive connection
the request went out on, stale if it closes before a byte of the answer came).
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from pdserve.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamStaleConnection,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pdserve.proxy.wire.connection import Connection

CLOSED_EARLY = "connection closed before the answer was complete"


class Server(Protocol):
    """What an error says of the server it was calling."""

    @property
    def url(self) -> str: ...
    @property
    def connect_timeout(self) -> float: ...


class Failures:
    """``with Failures(server, phase, limit):`` the wire's exceptions leave the block as pdserve's.

    ``limit`` is the time limit a timeout quotes: the one the caller set for what it waits on (a stream
    moves it from the first chunk's to the gaps' as it reads).
    """

    __slots__ = ("_phase", "_server", "connecting", "limit", "reused")

    def __init__(self, server: Server, phase: str, limit: float) -> None:
        self._server = server
        self._phase = phase
        self.limit = limit
        self.connecting: float | None = None  # a connection attempt's own limit, while one is under way
        self.reused: Connection | None = None  # the kept-alive connection the request went out on

    def __enter__(self) -> Failures:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, OSError):
            raise self.error(exc) from exc

    def is_stale(self, conn: Connection) -> bool:
        """``conn`` was a kept-alive one that closed before any answer: the request most likely never
        reached the server (which had closed it while idle), so sending it again on a fresh one is safe
        when sending twice is harmless."""
        return conn is self.reused and not conn.has_head

    def error(self, exc: OSError) -> UpstreamError:
        server, phase = self._server, self._phase
        if self.connecting is not None:
            if not isinstance(exc, TimeoutError):
                return UpstreamConnectError(phase, server.url, f"cannot connect ({exc})")
            if self.connecting >= server.connect_timeout:  # else the call's own limit ran out first
                detail = f"cannot connect within {server.connect_timeout:g} s"
                return UpstreamConnectError(phase, server.url, detail, is_slow=True)
        if isinstance(exc, TimeoutError):
            return UpstreamTimeout(phase, server.url, f"no answer within {self.limit:g} s")
        if isinstance(exc, ConnectionResetError) and self.reused is not None and not self.reused.has_head:
            return UpstreamStaleConnection(phase, server.url, f"{CLOSED_EARLY} (a kept-alive one)")
        if isinstance(exc, ConnectionResetError | BrokenPipeError):
            return UpstreamUnavailable(phase, server.url, CLOSED_EARLY)
        return UpstreamUnavailable(phase, server.url, f"{type(exc).__name__}: {exc}")
