"""The decode attempt: send the client's request with prefill's params to the decode the plan named and
relay its answer, untouched, once the lease guard trusts it.

Nothing reaches the client before decode's first chunk (streamed) or whole answer: a failure up to then
is returned (``DecodeFailed``), so the plan may try another decode; an answer that may rest on released
KV is withheld (``LeaseSuspect``). Once the client has bytes, a failure ends the stream with an error.

What only this attempt sees as the answer comes (its status, first byte, the moment the client's answer
begins, when the ledger must know the handoff delivered or refused, and each chunk's time) it tells the
plan through the ``DecodeStep``; it writes nothing about the request itself.
"""

from __future__ import annotations

import logging
import time

import orjson

from pdserve import protocol, sse
from pdserve.config import Timeouts
from pdserve.errors import (
    UpstreamConnectError,
    UpstreamDiverged,
    UpstreamError,
    UpstreamStaleConnection,
    UpstreamSuspectAnswer,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pdserve.proxy.request.plan import DecodeStep
from pdserve.proxy.request.steps import SERVED, DecodeFailed, LeaseSuspect, Served, describe, relay_rejection
from pdserve.proxy.wire.upstream import Reply, Stream, Upstream

log = logging.getLogger("pdserve.proxy")


class Decoder:
    def __init__(self, timeouts: Timeouts) -> None:
        self._t = timeouts

    async def attempt(
        self, step: DecodeStep, upstream: Upstream | None = None
    ) -> Served | DecodeFailed | LeaseSuspect:
        """Serve the client from the step's decode with its params (none: decode computes the prompt
        itself); a failure before the client's first byte is returned, unrelayed, so that another
        attempt may follow. ``upstream``: what to call instead of the instance's own (handover.py: a
        request already sent, a stream less the first token the client has)."""
        call, decode, params = step.call, step.instance, step.params
        up = decode.upstream if upstream is None else upstream
        payload = orjson.dumps(protocol.decode_body(call.body, params) if params is not None else call.body)
        decode.dispatch()
        try:
            if call.is_stream:
                result = await self._decode_stream(step, payload, up)
            else:
                result = await self._decode_whole(step, payload, up)
        except UpstreamError as exc:
            is_stale = isinstance(exc, UpstreamStaleConnection)
            # the connection's age, or a near tie in the logits, not the instance, failed that one
            if not is_stale and not isinstance(exc, UpstreamDiverged):
                decode.failed(exc.detail, is_slow=exc.is_slow)
            if isinstance(exc, UpstreamTimeout):
                exc = call.timeout_cause(exc)
            if call.out.started:
                raise exc from None
            return DecodeFailed(exc, kv_unused=isinstance(exc, UpstreamConnectError), is_stale=is_stale)
        finally:
            decode.undispatch()
        if isinstance(result, DecodeFailed):
            decode.failed(describe(result.failure))
        elif call.out.has_error_event:
            decode.failed("streamed an error event")
        else:
            decode.succeeded()
        return result

    async def _decode_whole(
        self, step: DecodeStep, payload: bytes, up: Upstream
    ) -> Served | DecodeFailed | LeaseSuspect:
        call, decode = step.call, step.instance
        limit = call.limit("decode", decode.url, self._t.decode)
        reply = await up.post(call.path, payload, call.headers, "decode", limit)
        status = reply.status
        step.answered(status, time.perf_counter())
        if status >= 500:
            return DecodeFailed(reply)
        if status == 200 and (suspect := await step.trusted()) is not None:
            return suspect
        step.begins(status)
        if status != 200:
            await relay_rejection("decode", decode.url, reply, call.out)
        else:
            await call.out.relay(200, reply.content_type, _without_transfer_metadata(reply.body))
        step.chunk(time.perf_counter())
        return SERVED if status == 200 else Served(status)

    async def _decode_stream(
        self, step: DecodeStep, payload: bytes, up: Upstream
    ) -> Served | DecodeFailed | LeaseSuspect:
        call, decode = step.call, step.instance
        # The first chunk's budget is what the status line left of first_token, not a fresh one.
        first_token = call.limit("decode", decode.url, self._t.first_token)
        first_chunk_deadline = time.monotonic() + first_token
        # Within this the instance owes the stream its first byte: how long the oldest such wait is tells
        # a stalled engine from a busy one (``Instance.lag_s``).
        decode.owe_first_byte(key := id(step))
        try:
            async with up.open_stream(call.path, payload, call.headers, "decode", first_token) as resp:
                status = resp.status
                step.answered(status, None)
                if status != 200:
                    decode.first_byte(key)
                    reply = Reply(status, resp.content_type, await resp.read_all(self._t.idle))
                    if status >= 500:
                        return DecodeFailed(reply)
                    step.begins(status)
                    await relay_rejection("decode", decode.url, reply, call.out)
                    return Served(status)
                first_timeout = max(0.0, first_chunk_deadline - time.monotonic())
                return await self._relay(step, resp, first_timeout, key)
        finally:
            decode.first_byte(key)

    async def _relay(
        self, step: DecodeStep, resp: Stream, first_timeout: float, key: int
    ) -> Served | DecodeFailed | LeaseSuspect:
        """Forward decode's SSE bytes untouched, watching only for vLLM's error event and [DONE].

        The client's stream starts with the first chunk, not before: an error event as the very
        first thing (e.g. the KV pull failed) can still be retried elsewhere unless this is the last
        try, and the lease guard has its say before any byte goes out.
        """
        call, decode, on_chunk = step.call, step.instance, step.chunk
        out, progress = call.out, call.progress
        watch = sse.StreamWatch()
        async for chunk in resp.chunks(first_timeout, self._t.idle, self._t.first_token):
            is_error = watch.feed(chunk)
            if not out.started:
                decode.first_byte(key)
                now = time.perf_counter()
                if is_error and not step.is_last:
                    step.answered(200, now)
                    return DecodeFailed(Reply(200, resp.content_type, chunk))
                if (suspect := await step.trusted(now)) is not None:
                    return suspect
                await out.open_stream(resp.content_type)
                step.begins(200)
            if is_error:
                # vLLM's event says only what failed; the client also learns where (error path only).
                chunk = protocol.with_error_event_origin(
                    chunk, f"decode instance {out.name_instances(decode.url)}"
                )
                if not out.has_error_event:
                    out.error_event_relayed("decode streamed an error event")
                    log.warning("request %s: decode %s streamed an error event", call.request_id, decode.url)
            if watch.has_done and (why := await step.before_the_end()) is not None:
                # a stream prefill's log discredits ends with an error naming the lease, not [DONE]
                raise UpstreamSuspectAnswer(
                    "decode", decode.url, f"KV lease: {why}; this answer may be wrong"
                )
            if progress is not None and not (chunk := progress.feed(chunk)):
                continue  # an event cut by the chunk's edge: the rest comes next (progress.py)
            await out.chunk(chunk)
            on_chunk(time.perf_counter())
        if not watch.has_done:
            # A stream that stops without [DONE] would look like a short answer to the client.
            raise UpstreamUnavailable("decode", decode.url, "stream ended before it was complete")
        await out.end()
        return SERVED


def _without_transfer_metadata(body: bytes) -> bytes:
    """Decode's whole answer less its ``kv_transfer_params``. vLLM prints compact JSON with that key
    after others, so cutting it out of the bytes is exact and skips parsing and re-encoding the whole
    answer (a quote inside a JSON string is escaped: no text can fake the key); any other shape is parsed."""
    spliced = body.replace(b',"kv_transfer_params":null', b"", 1)
    if len(spliced) < len(body) and b'"kv_transfer_params"' not in spliced:
        return spliced
    return protocol.without_transfer_metadata(body)
