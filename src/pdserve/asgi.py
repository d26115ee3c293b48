"""Raw ASGI plumbing shared by the proxy's and the simulator's generation routes: body reading with a
limit, header lookup, one response writer, and running work until the client disconnects.

Both serve generation as plain ASGI apps rather than framework endpoints: streamed bytes go to ``send``
with no per-chunk wrapping, and a client that hangs up must cancel the work at once, streamed or not,
which needs ``receive`` watched for the whole life of the request. This module is tested on its own
(tests/test_asgi.py), so a bug here shows there, not as a puzzle on both sides of a fault test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Final, Protocol

from pdserve.errors import BodyTooLarge, ClientGone

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

JSON: Final = b"application/json"
EVENT_STREAM: Final = b"text/event-stream; charset=utf-8"


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; ``BodyTooLarge`` past ``limit`` bytes, ``ClientGone`` on disconnect."""
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


def three_headers(
    scope: Scope, first: bytes, second: bytes, third: bytes
) -> tuple[str | None, str | None, str | None]:
    """``(header(scope, first), header(scope, second), header(scope, third))`` in one pass."""
    one = two = three = None
    for key, value in scope["headers"]:
        if key == first:
            if one is None:
                one = bytes(value).decode("latin-1")
        elif key == second:
            if two is None:
                two = bytes(value).decode("latin-1")
        elif key == third and three is None:
            three = bytes(value).decode("latin-1")
    return one, two, three


class ResponseWriter:
    """Writes one response to ``send`` and knows how far it got: ``started`` once the status line went
    out, ``finished`` once the last byte was handed over. Subclasses add headers to every response."""

    __slots__ = ("_send", "finished", "started", "status")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.status: int | None = None  # what the client was answered

    def _headers(self) -> list[tuple[bytes, bytes]]:
        return []

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def whole(
        self, status: int, body: bytes, content_type: bytes | None = JSON, extra: Headers = ()
    ) -> None:
        headers = [*self._headers(), (b"content-length", str(len(body)).encode())]
        if content_type is not None:
            headers.append((b"content-type", content_type))
        await self._start(status, [*headers, *extra])
        # Finished before the last send: a disconnect the server reports after it must not cancel
        # the work's bookkeeping, since the client has everything.
        self.finished = True
        await self._send({"type": "http.response.body", "body": body})

    async def start_stream(self, content_type: bytes = EVENT_STREAM, extra: Headers = ()) -> None:
        await self._start(200, [*self._headers(), (b"content-type", content_type), *extra])

    def chunk(self, data: bytes) -> Awaitable[None]:
        # the send itself, not a coroutine awaiting it: a frame fewer on every token of every stream
        return self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": data})


class Finishing(Protocol):
    @property
    def finished(self) -> bool: ...


async def run_until_disconnect(
    work: Awaitable[None],
    receive: Receive,
    responder: Finishing,
    await_close: Callable[[], bool] | None = None,
    close_wait_s: float = 1.0,
    loop: asyncio.AbstractEventLoop | None = None,
) -> bool:
    """Run ``work``; if the client disconnects first, cancel it. True when the client went away.

    ASGI servers also report ``http.disconnect`` once the response is complete, so a disconnect after
    ``responder.finished`` lets the work finish its bookkeeping instead of cancelling it. When
    ``await_close()`` says so after the work (it dropped the connection on purpose), the server's own
    disconnect notice is awaited, at most ``close_wait_s``, so the app never returns before the server
    knows the connection is gone. ``loop``: the running loop, if the caller has it at hand (looking it
    up costs a getpid() syscall on CPython 3.11).
    """
    # The work runs in this task (one task fewer per request): a disconnect cancels this task, and the
    # cancellation is taken back here once the work has run its cleanup (closing upstream connections).
    loop = loop or asyncio.get_running_loop()
    current = asyncio.current_task(loop)
    assert current is not None, "run_until_disconnect runs in a task"
    is_gone = is_done = False

    def on_disconnect(_: object) -> None:
        nonlocal is_gone
        if not is_done and not responder.finished:
            is_gone = True
            current.cancel()

    # A callback, not asyncio.wait: this runs once per request, and wait's bookkeeping showed up.
    watcher = loop.create_task(wait_for_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        try:
            await work
        except asyncio.CancelledError:
            if not is_gone or current.uncancel() > 0:
                raise  # this task itself is being cancelled, not only the work
            return True
        finally:
            is_done = True
        if await_close is not None and await_close():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(watcher), close_wait_s)
    finally:
        watcher.cancel()
    return False


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
