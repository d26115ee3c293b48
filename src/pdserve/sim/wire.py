"""The simulator's response writer: vLLM's headers, plus closing a connection without an answer (the
"process died" faults).

Closing a connection: under uvicorn the ``send`` callable is a bound method of the connection's
request cycle, which holds the transport, so the app can close it directly, flushing what was already
written, as the kernel does when a process dies. Elsewhere ``ConnectionDropped`` is raised instead and
the server closes the connection (``server.py`` keeps uvicorn from logging it as an error). That reach
into uvicorn is not its public API: tests/proxy/test_server.py fails, naming it, if a release moves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from pdserve.asgi import EVENT_STREAM, JSON, Receive, ResponseWriter, Send, wait_for_disconnect
from pdserve.errors import ConnectionDropped

__all__ = [
    "DISCONNECT_WAIT_S",
    "EVENT_STREAM",
    "JSON",
    "DroppedConnectionFilter",
    "Writer",
    "drop_unanswered",
]

DISCONNECT_WAIT_S: Final = 2.0


class DroppedConnectionFilter(logging.Filter):
    """Keeps uvicorn from logging an injected ``ConnectionDropped`` as "Exception in ASGI application"."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ConnectionDropped)


class Writer(ResponseWriter):
    """Writes one response as vLLM's server does; can also die mid-way."""

    __slots__ = ("dropped",)

    def __init__(self, send: Send) -> None:
        super().__init__(send)
        self.dropped = False

    async def partial(self, status: int, body: bytes, num_bytes: int) -> None:
        """Headers announcing ``body`` whole, then only its first ``num_bytes`` (the answer dies mid-way)."""
        headers = [(b"content-length", str(len(body)).encode()), (b"content-type", JSON)]
        await self._start(status, headers)
        await self.chunk(body[:num_bytes])

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
