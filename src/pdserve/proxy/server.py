"""Serving the proxy app: uvicorn on uvloop with httptools, access log and proxy headers off (the proxy is
on every token's path), generation routes dispatched before Starlette (``ProxyApp``), and each
connection's writes of one loop turn sent as one (``CorkedTransport``).

``_CorkedHttpToolsProtocol`` subclasses a uvicorn class that is not its public API: pyproject.toml pins
uvicorn's minor release, and tests/proxy/test_server.py names what changed if an upgrade breaks it."""

from __future__ import annotations

import asyncio
import gc
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.config import ProxyConfig
from pdserve.proxy.app import ProxyApp, create_app


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


class _CorkedHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, CorkedTransport(transport, self.loop)))


def make_server(config: ProxyConfig, log_level: str = "info", app: Starlette | None = None) -> uvicorn.Server:
    uv_config = uvicorn.Config(
        ProxyApp(app or create_app(config)),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=_CorkedHttpToolsProtocol,
        access_log=False,
        # X-Forwarded-* rewriting of the client address: nothing in the proxy reads that address.
        proxy_headers=False,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=30,
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
