"""A request's path through the proxy, top to bottom.

    parse → pick prefill → prefill (max_tokens=1, do_remote_decode) → read kv_transfer_params
          → pick decode → decode (client's own request + params; decode pulls the KV over NIXL)
          → relay decode's answer to the client

The KV cache never passes through here: only its address (``kv_transfer_params``) does. Every way a
call can fail ends the client's request with an error naming the phase and instance; vLLM's own
rejections (4xx, 5xx) reach the client with vLLM's status and body.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdserve import protocol
from pdserve.config import Timeouts
from pdserve.errors import UpstreamError, UpstreamProtocolError, UpstreamUnavailable
from pdserve.protocol import SSE_DONE_MARK, SSE_ERROR_MARK, BadRequest, Endpoint
from pdserve.proxy.asgi import Responder
from pdserve.proxy.routing import Policy
from pdserve.proxy.upstream import StreamReply, Upstream

log = logging.getLogger("pdserve.proxy")

_MARK_TAIL = max(len(SSE_DONE_MARK), len(SSE_ERROR_MARK))


@dataclass
class Trace:
    """What happened to one request: the walk-through `pdserve demo` prints and /requests serves."""

    request_id: str
    endpoint: Endpoint
    stream: bool
    started: float = field(default_factory=time.time)
    prefill_url: str | None = None
    prefill_status: int | None = None
    prefill_ms: float | None = None
    kv_transfer_params: dict[str, Any] | None = None
    local_prefill_reason: str | None = None  # set when the request was not split, and why
    decode_url: str | None = None
    decode_status: int | None = None
    total_ms: float | None = None
    error: str | None = None  # the error the client received, if any
    stream_error_event: bool = False  # decode streamed vLLM's own error event

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Flow:
    def __init__(
        self,
        prefill: Sequence[Upstream],
        decode: Sequence[Upstream],
        prefill_policy: Policy,
        decode_policy: Policy,
        timeouts: Timeouts,
        num_traces: int = 256,
    ) -> None:
        self.prefill = tuple(prefill)
        self.decode = tuple(decode)
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._t = timeouts
        self.traces: deque[Trace] = deque(maxlen=num_traces)

    async def serve(self, endpoint: Endpoint, raw: bytes, auth: str | None, out: Responder) -> None:
        try:
            body = protocol.client_body(protocol.parse_body(raw))
        except BadRequest as exc:
            await out.error(400, exc.message, "BadRequestError", exc.param)
            return
        trace = Trace(out.request_id, endpoint, stream=body.get("stream") is True)
        self.traces.append(trace)
        headers = {"X-Request-Id": out.request_id}
        if auth is not None:
            headers["Authorization"] = auth
        begun = time.perf_counter()
        try:
            await self._serve(endpoint, body, headers, trace, out)
        except UpstreamError as exc:
            trace.error = str(exc)
            log.warning("request %s failed: %s", out.request_id, exc)
            await out.error(exc.status, str(exc), exc.error_type)
        finally:
            trace.total_ms = (time.perf_counter() - begun) * 1000
            if not out.finished and trace.error is None:
                trace.error = "client disconnected"

    async def _serve(
        self, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str], trace: Trace, out: Responder
    ) -> None:
        path = protocol.PATHS[endpoint]
        trace.local_prefill_reason = protocol.needs_local_prefill(body)
        if trace.local_prefill_reason is None:
            kv_params = await self._prefill(path, body, headers, trace, out)
            if kv_params is None:
                return  # prefill's own error already went to the client
            body = protocol.decode_body(body, kv_params)
        else:
            log.info("request %s served by decode alone: %s", out.request_id, trace.local_prefill_reason)

        decode = self._decode_policy.choose(self.decode)
        trace.decode_url = decode.url
        payload = orjson.dumps(body)
        if not trace.stream:
            reply = await decode.post(path, payload, headers, "decode", self._t.decode)
            trace.decode_status = reply.status
            if reply.status != 200:
                await _relay_rejection(
                    "decode", decode, reply.status, reply.content_type, reply.body, trace, out
                )
                return
            await out.whole(200, reply.content_type, protocol.without_transfer_metadata(reply.body))
            return
        # The first chunk's budget is what the status line left of first_token, not a fresh one.
        first_chunk_deadline = time.monotonic() + self._t.first_token
        async with decode.open_stream(path, payload, headers, "decode", self._t.first_token) as resp:
            trace.decode_status = resp.status
            if resp.status != 200:
                rejection = await resp.read_all(self._t.idle)
                await _relay_rejection(
                    "decode", decode, resp.status, resp.content_type, rejection, trace, out
                )
                return
            await self._relay(resp, decode, max(0.0, first_chunk_deadline - time.monotonic()), trace, out)

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str], trace: Trace, out: Responder
    ) -> dict[str, Any] | None:
        """Run prefill; its ``kv_transfer_params``, or None after relaying vLLM's own rejection."""
        prefill = self._prefill_policy.choose(self.prefill)
        trace.prefill_url = prefill.url
        begun = time.perf_counter()
        payload = orjson.dumps(protocol.prefill_body(body))
        reply = await prefill.post(path, payload, headers, "prefill", self._t.prefill)
        trace.prefill_ms = (time.perf_counter() - begun) * 1000
        trace.prefill_status = reply.status
        if reply.status != 200:
            await _relay_rejection(
                "prefill", prefill, reply.status, reply.content_type, reply.body, trace, out
            )
            return None
        try:
            params = protocol.kv_params_from_prefill(reply.body)
        except ValueError as exc:
            raise UpstreamProtocolError("prefill", prefill.url, str(exc)) from None
        trace.kv_transfer_params = params
        return params

    async def _relay(
        self, resp: StreamReply, decode: Upstream, first_timeout: float, trace: Trace, out: Responder
    ) -> None:
        """Forward decode's SSE bytes untouched, watching only for vLLM's error event and [DONE]."""
        await out.start_stream(resp.content_type)
        # Markers include the blank line that ends the previous event: JSON strings cannot hold a raw
        # newline, so a token's text can never fake one. The stream's start counts as an event boundary.
        tail = b"\n\n"
        is_done = False
        async for chunk in resp.chunks(first_timeout, self._t.idle):
            await out.chunk(chunk)
            window = tail + chunk  # markers may straddle chunks
            if SSE_ERROR_MARK in window and not trace.stream_error_event:
                trace.stream_error_event = True
                trace.error = "decode streamed an error event"
                log.warning("request %s: decode %s streamed an error event", out.request_id, decode.url)
            if SSE_DONE_MARK in window:
                is_done = True
            tail = window[-_MARK_TAIL:]
        if not is_done:
            # A stream that stops without [DONE] would look like a short answer to the client.
            raise UpstreamUnavailable("decode", decode.url, "stream ended before it was complete")
        await out.end()


async def _relay_rejection(
    phase: str, upstream: Upstream, status: int, content_type: str, body: bytes, trace: Trace, out: Responder
) -> None:
    """An instance's non-200 answer goes to the client with its status; a 5xx also names who failed."""
    trace.error = f"{phase} answered {status}"
    if status >= 500:
        body = protocol.with_error_origin(body, f"{phase} instance {upstream.url}")
    await out.whole(status, content_type, body)
