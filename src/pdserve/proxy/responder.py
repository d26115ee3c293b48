"""The proxy's response writer: every answer carries the request id; errors take the form the client
can still read (a JSON error before the status line went out, an SSE error event after). It keeps what
it told the client went wrong, the one account of that which /requests and the outcome counts read."""

from __future__ import annotations

from pdserve import sse
from pdserve.asgi import JSON, Headers, ResponseWriter, Send
from pdserve.protocol import error_body


class Responder(ResponseWriter):
    __slots__ = ("_request_id", "failure", "has_error_event", "request_id")

    def __init__(self, send: Send, request_id: str) -> None:
        super().__init__(send)
        self.request_id = request_id
        self._request_id = request_id.encode("latin-1")
        self.failure: str | None = None  # what the client was told went wrong, if anything
        self.has_error_event = False  # an instance's own SSE error event went into the stream

    def error_event_relayed(self, failure: str) -> None:
        """The stream being relayed carries the instance's error event (the relay sends it as it is)."""
        self.has_error_event = True
        self.failure = failure

    def _headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"x-request-id", self._request_id)]

    async def relay(self, status: int, content_type: str, body: bytes, failure: str | None = None) -> None:
        """An instance's whole answer, with its own content type; ``failure`` says what a rejection was."""
        if failure is not None:
            self.failure = failure
        await self.whole(status, body, content_type.encode("latin-1"))

    async def open_stream(self, content_type: str) -> None:
        await self.start_stream(content_type.encode("latin-1"), [(b"cache-control", b"no-cache")])

    async def error(
        self, status: int, message: str, err_type: str, param: str | None = None, extra: Headers = ()
    ) -> None:
        """An OpenAI-style error: a JSON response, or an SSE error event if a stream already began."""
        self.failure = message
        payload = error_body(message, err_type, status, param)
        if not self.started:
            await self.whole(status, payload, JSON, extra)
        elif not self.finished:
            await self.end(sse.event(payload) + sse.DONE)
