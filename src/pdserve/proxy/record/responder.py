"""The proxy's response writer: every answer carries the request id; errors take the form the client
can still read (a JSON error before the status line went out, an SSE error event after). It keeps what
it told the client went wrong, the one account of that which /requests and the outcome counts read."""

from __future__ import annotations

from collections.abc import Callable

from pdserve import sse
from pdserve.asgi import JSON, Headers, ResponseWriter, Send
from pdserve.protocol import error_body

Redact = Callable[[str], str]  # a client-facing text with each instance's URL replaced by its name


class Responder(ResponseWriter):
    """``redact``: what the client reads of an instance names it so (errors only, never a token's path);
    ``replaced_id``: why the client's own X-Request-Id was not used, said in ``x-request-id-replaced``."""

    __slots__ = ("_headers_out", "_redact", "_request_id", "failure", "has_error_event", "request_id")

    def __init__(
        self, send: Send, request_id: str, redact: Redact | None = None, replaced_id: str | None = None
    ) -> None:
        super().__init__(send)
        self.request_id = request_id
        self._request_id = request_id.encode("latin-1")
        self._redact = redact
        self._headers_out = [(b"x-request-id", self._request_id)]
        if replaced_id is not None:
            self._headers_out.append((b"x-request-id-replaced", replaced_id.encode("latin-1")))
        self.failure: str | None = None  # what the client was told went wrong, if anything
        self.has_error_event = False  # an instance's own SSE error event went into the stream

    def name_instances(self, text: str) -> str:
        """``text`` as a client may read it: instances by pool name unless the proxy shows URLs."""
        return text if self._redact is None else self._redact(text)

    def error_event_relayed(self, failure: str) -> None:
        """The stream being relayed carries the instance's error event (the relay sends it as it is)."""
        self.has_error_event = True
        self.failure = failure

    def _headers(self) -> list[tuple[bytes, bytes]]:
        return self._headers_out  # callers copy it

    async def relay(self, status: int, content_type: str, body: bytes, failure: str | None = None) -> None:
        """An instance's whole answer, with its own content type; ``failure`` says what a rejection was."""
        if failure is not None:
            self.failure = failure
            if self._redact is not None:  # a rejection may name the instance (with_error_origin)
                body = self._redact(body.decode("utf-8", "replace")).encode()
        await self.whole(status, body, content_type.encode("latin-1"))

    async def open_stream(self, content_type: str) -> None:
        await self.start_stream(content_type.encode("latin-1"), [(b"cache-control", b"no-cache")])

    async def error(
        self, status: int, message: str, err_type: str, param: str | None = None, extra: Headers = ()
    ) -> None:
        """An OpenAI-style error: a JSON response, or an SSE error event if a stream already began."""
        self.failure = message
        payload = error_body(self.name_instances(message), err_type, status, param)
        if not self.started:
            await self.whole(status, payload, JSON, extra)
        elif not self.finished:
            await self.end(sse.event(payload) + sse.DONE)
