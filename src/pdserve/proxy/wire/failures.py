"""The one place where what the proxy's HTTP client meets underneath becomes pdserve's errors.

Underneath client.py are the OS's socket errors, asyncio's ``TimeoutError`` (a deadline of connection.py
or ``asyncio.timeout``), and connection.py's own: ``ConnectionResetError`` for a connection that closed
before the answer was complete, ``ConnectionError`` for an answer httptools could not parse. All of them
are ``OSError`` (``TimeoutError`` is one since Python 3.10), and ``failure`` turns each into the
``UpstreamError`` that names the phase, the server and what went wrong, as httpx's
``map_httpcore_exceptions()`` does for httpcore's. Every call site in client.py is one
``except OSError as exc: raise failure(...) from exc``; anything else passes untouched: cancellation,
the ``ValueError`` of a header that would split the request, pdserve's own errors.

A function, not a context manager: ``with`` costs an object and two calls on every call whether it fails
or not (about 4,000 instructions, 2-3 % of a streamed call of the wire), while an ``except`` costs
nothing until something fails, and every token passes here.

What went wrong depends on how far the call got, which the call site says: ``connecting`` (the limit
of a connection attempt under way) and ``reused`` (the kept-alive connection the request went out on,
stale if it closes before a byte of the answer came).
"""

from __future__ import annotations

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


def failure(
    exc: OSError,
    server: Server,
    phase: str,
    limit: float,
    reused: Connection | None = None,
    connecting: float | None = None,
) -> UpstreamError:
    """``exc`` as pdserve's error. ``limit`` is the time limit a timeout quotes: the one the caller set
    for what it waited on (a stream's first chunk has its own, then the gaps')."""
    if connecting is not None:
        if not isinstance(exc, TimeoutError):
            return UpstreamConnectError(phase, server.url, f"cannot connect ({exc})")
        if connecting >= server.connect_timeout:  # else the call's own limit ran out first
            detail = f"cannot connect within {server.connect_timeout:g} s"
            return UpstreamConnectError(phase, server.url, detail, is_slow=True)
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(phase, server.url, f"no answer within {limit:g} s")
    if isinstance(exc, ConnectionResetError) and reused is not None and not reused.has_head:
        return UpstreamStaleConnection(phase, server.url, f"{CLOSED_EARLY} (a kept-alive one)")
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return UpstreamUnavailable(phase, server.url, CLOSED_EARLY)
    return UpstreamUnavailable(phase, server.url, f"{type(exc).__name__}: {exc}")
