"""Raw ASGI pieces for the generation endpoints: body reading, a response writer, disconnect watching.

The generation routes are plain ASGI apps rather than Starlette endpoints for two reasons: the relay
loop forwards upstream bytes to ``send`` with no per-chunk wrapping, and a client that hangs up must
cancel the upstream calls at once in either phase, streamed or not, which needs ``receive`` watched
for the whole life of the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from pdserve.protocol import SSE_DONE, error_body, sse_event

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (``name`` lower-case, as ASGI gives them)."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class Responder:
    """Writes one response to ``send``; knows whether the headers went out, so errors pick their form."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self.request_id = request_id
        self._request_id = request_id.encode("latin-1")
        self.started = False
        self.finished = False
        self.status: int | None = None  # what the client was answered

    def _headers(self, content_type: str) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", content_type.encode("latin-1")), (b"x-request-id", self._request_id)]

    async def whole(
        self, status: int, content_type: str, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self.started = True
        self.status = status
        headers = self._headers(content_type) + (extra or [])
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
        self.finished = True

    async def error(
        self,
        status: int,
        message: str,
        err_type: str,
        param: str | None = None,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """An OpenAI-style error: a JSON response, or an SSE error event if a stream already began."""
        payload = error_body(message, err_type, status, param)
        if not self.started:
            await self.whole(status, "application/json", payload, extra)
        elif not self.finished:
            await self.chunk(sse_event(payload) + SSE_DONE)
            await self.end()

    async def start_stream(self, content_type: str) -> None:
        self.started = True
        self.status = 200
        headers = [*self._headers(content_type), (b"cache-control", b"no-cache")]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b""})
        self.finished = True


class Finishing(Protocol):
    @property
    def finished(self) -> bool: ...


async def run_until_disconnect(
    work: Awaitable[None],
    receive: Receive,
    responder: Finishing,
    await_close: Callable[[], bool] | None = None,
    close_wait_s: float = 1.0,
) -> bool:
    """Run ``work``; if the client disconnects first, cancel it. True when the client went away.

    ASGI servers also report ``http.disconnect`` once the response is complete, so a disconnect after
    ``responder.finished`` lets the work finish its bookkeeping instead of cancelling it. When
    ``await_close()`` says so after the work (it dropped the connection on purpose), the server's own
    disconnect notice is awaited, at most ``close_wait_s``, so the app never returns before the server
    knows the connection is gone.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work_task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not work_task.done() and not responder.finished:
            work_task.cancel()
        # Cancelled work still runs its cleanup (closing upstream connections) before we return.
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        if await_close is not None and await_close():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(watcher), close_wait_s)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.cancelled():
        return True
    work_task.result()  # re-raise a failure of the work itself
    return False


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
