"""Raw ASGI plumbing for the simulator: a response writer with vLLM's headers, disconnect watching, and
closing a connection without an answer (the "process died" faults).

Closing a connection: under uvicorn the ``send`` callable is a bound method of the connection's
request cycle, which holds the transport, so the app can close it directly, flushing what was already
written, as the kernel does when a process dies. Elsewhere ``ConnectionDropped`` is raised instead and
the server closes the connection (``server.py`` keeps uvicorn from logging it as an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from pdserve.proxy.asgi import Receive, Send, wait_for_disconnect

JSON: Final = b"application/json"
EVENT_STREAM: Final = b"text/event-stream; charset=utf-8"
DISCONNECT_WAIT_S: Final = 2.0


class ConnectionDropped(Exception):
    """Raised out of the app to make the server close the connection (fallback of ``drop``)."""


class DroppedConnectionFilter(logging.Filter):
    """Keeps uvicorn from logging an injected ``ConnectionDropped`` as "Exception in ASGI application"."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ConnectionDropped)


class Writer:
    """Writes one response; knows whether the headers went out and whether it is complete."""

    __slots__ = ("_send", "dropped", "finished", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.dropped = False

    async def whole(self, status: int, body: bytes, content_type: bytes | None = JSON) -> None:
        headers = [(b"content-length", str(len(body)).encode())]
        if content_type is not None:
            headers.append((b"content-type", content_type))
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        self.finished = True
        await self._send({"type": "http.response.body", "body": body})

    async def partial(self, status: int, body: bytes, num_bytes: int) -> None:
        """Headers announcing ``body`` whole, then only its first ``num_bytes`` (the answer dies mid-way)."""
        headers = [(b"content-length", str(len(body)).encode()), (b"content-type", JSON)]
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body[:num_bytes], "more_body": True})

    async def start_stream(self) -> None:
        self.started = True
        headers = [(b"content-type", EVENT_STREAM)]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": data})

    def drop(self) -> None:
        """Close the connection now, after what was already sent; raise ConnectionDropped if we cannot."""
        self.finished = self.dropped = True
        transport = getattr(getattr(self._send, "__self__", None), "transport", None)
        if transport is None or not hasattr(transport, "close"):
            raise ConnectionDropped
        transport.close()


async def drop_unanswered(send: Send, receive: Receive) -> None:
    """Close the connection without an answer and return once the server has seen it close."""
    Writer(send).drop()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wait_for_disconnect(receive), DISCONNECT_WAIT_S)
