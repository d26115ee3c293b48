"""How the proxy talks to one instance: the ``Upstream`` protocol the flow calls, and ``HTTPUpstream``,
the proxy's HTTP client (client.py) pointed at an instance's URL.

Its calls succeed or raise an ``UpstreamError`` naming the phase and the instance (failures.py makes
them), so the flow reads as success-or-error. Tests give the flow an in-memory ``Upstream`` instead
(tests/proxy/memory_upstream.py).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol
from urllib.parse import urlsplit

from pdserve.config import Role
from pdserve.proxy.wire.client import Address, Client
from pdserve.proxy.wire.client import Reply as Reply  # what the flow's steps read, from here
from pdserve.proxy.wire.connection import RequestWriter


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


class HTTPUpstream(Client):
    """``Upstream`` over HTTP/1.1: the client with one pool of keep-alive connections to the instance."""

    def __init__(self, role: Role, url: str, connect_timeout: float, max_connections: int) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"instance URL must be http(s)://host[:port], got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        tls = ssl.create_default_context() if parts.scheme == "https" else None
        request = RequestWriter(parts.netloc, parts.path.rstrip("/"))
        super().__init__(url, Address(parts.hostname, port, tls), request, connect_timeout, max_connections)
        self.role = role
