"""The decode attempt: send the client's request with prefill's params to one decode instance and relay
its answer, untouched, once the lease guard trusts it.

Nothing reaches the client before decode's first chunk (streamed) or whole answer: a failure up to then
is returned (``DecodeFailed``), so the flow may try another decode; an answer that may rest on released
KV is withheld (``LeaseSuspect``). Once the client has bytes, a failure ends the stream with an error.

The handoff in play is the flow's (``HandoffSlot``); decode closes it only at the moment its answer
begins, because that is when the ledger must know it: delivered, refused (a 4xx), or suspect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import orjson

from pdserve import protocol, sse
from pdserve.config import ProxyConfig
from pdserve.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamStaleConnection,
    UpstreamSuspectAnswer,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pdserve.proxy.attempt import (
    Call,
    DecodeFailed,
    HandoffSlot,
    LeaseSuspect,
    Served,
    describe,
    relay_rejection,
)
from pdserve.proxy.guard import LeaseGuard
from pdserve.proxy.instance import Instance
from pdserve.proxy.upstream import Reply, Stream

log = logging.getLogger("pdserve.proxy")


class Decoder:
    def __init__(self, config: ProxyConfig, guard: LeaseGuard) -> None:
        self._t = config.timeouts
        self._guard = guard

    async def attempt(
        self, call: Call, decode: Instance, slot: HandoffSlot, is_last: bool
    ) -> Served | DecodeFailed | LeaseSuspect:
        """Serve the client from ``decode`` with the handoff in ``slot`` (none: decode computes the prompt
        itself); a failure before the client's first byte is returned, unrelayed, so that another
        attempt may follow."""
        handoff = slot.handoff
        payload = orjson.dumps(protocol.decode_body(call.body, handoff.params) if handoff else call.body)
        call.timeline.decode_sent = time.perf_counter()
        with decode.dispatched():
            try:
                if call.is_stream:
                    result = await self._decode_stream(call, decode, slot, payload, is_last)
                else:
                    result = await self._decode_whole(call, decode, slot, payload)
            except UpstreamError as exc:
                is_stale = isinstance(exc, UpstreamStaleConnection)
                if not is_stale:  # the connection's age, not the instance, failed that one
                    decode.failed(exc.detail, is_slow=exc.is_slow)
                if isinstance(exc, UpstreamTimeout):
                    exc = call.timeout_cause(exc)
                if call.out.started:
                    raise exc from None
                return DecodeFailed(exc, kv_unused=isinstance(exc, UpstreamConnectError), is_stale=is_stale)
        if isinstance(result, DecodeFailed):
            decode.failed(describe(result.failure))
        elif call.out.has_error_event:
            decode.failed("streamed an error event")
        else:
            decode.succeeded()
        return result

    async def _suspect(self, call: Call, decode: Instance, slot: HandoffSlot) -> LeaseSuspect | None:
        """The lease guard's verdict on decode's answer, which is about to begin; the handoff of a
        suspect one is closed as such, and decode's prefix cache emptied of what the pull left."""
        if slot.handoff is None:
            return None
        suspicion = await self._guard.check(slot.handoff)
        if suspicion is None:
            return None
        log.warning("request %s: not relaying decode's answer: %s", call.request_id, suspicion.why)
        slot.suspect(suspicion.kind, suspicion.why)
        await self._guard.purge(decode)
        return LeaseSuspect(suspicion.why)

    async def _decode_whole(
        self, call: Call, decode: Instance, slot: HandoffSlot, payload: bytes
    ) -> Served | DecodeFailed | LeaseSuspect:
        limit = call.limit("decode", decode.url, self._t.decode)
        reply = await decode.upstream.post(call.path, payload, call.headers, "decode", limit)
        call.timeline.decode_first_byte = time.perf_counter()
        call.trace.decode_status = reply.status
        if reply.status >= 500:
            return DecodeFailed(reply)
        if reply.status == 200 and (suspect := await self._suspect(call, decode, slot)) is not None:
            return suspect
        _close_handoff(slot, decode, reply.status)
        if reply.status != 200:
            await relay_rejection("decode", decode.url, reply, call.out)
        else:
            await call.out.relay(200, reply.content_type, _without_transfer_metadata(reply.body))
        call.timeline.chunk(time.perf_counter())
        return Served()

    async def _decode_stream(
        self, call: Call, decode: Instance, slot: HandoffSlot, payload: bytes, is_last: bool
    ) -> Served | DecodeFailed | LeaseSuspect:
        # The first chunk's budget is what the status line left of first_token, not a fresh one.
        first_token = call.limit("decode", decode.url, self._t.first_token)
        first_chunk_deadline = time.monotonic() + first_token
        with decode.awaiting_first_byte() as first_byte_came:
            async with decode.upstream.open_stream(
                call.path, payload, call.headers, "decode", first_token
            ) as resp:
                call.trace.decode_status = resp.status
                if resp.status != 200:
                    first_byte_came()
                    reply = Reply(resp.status, resp.content_type, await resp.read_all(self._t.idle))
                    if resp.status >= 500:
                        return DecodeFailed(reply)
                    _close_handoff(slot, decode, resp.status)
                    await relay_rejection("decode", decode.url, reply, call.out)
                    return Served()
                first_timeout = max(0.0, first_chunk_deadline - time.monotonic())
                return await self._relay(call, resp, decode, slot, first_timeout, is_last, first_byte_came)

    async def _relay(
        self,
        call: Call,
        resp: Stream,
        decode: Instance,
        slot: HandoffSlot,
        first_timeout: float,
        is_last: bool,
        first_byte_came: Callable[[], None],
    ) -> Served | DecodeFailed | LeaseSuspect:
        """Forward decode's SSE bytes untouched, watching only for vLLM's error event and [DONE].

        The client's stream starts with the first chunk, not before: an error event as the very
        first thing (e.g. the KV pull failed) can still be retried elsewhere unless this is the last
        try, and the lease guard has its say before any byte goes out.
        """
        out, progress = call.out, call.progress
        watch = sse.StreamWatch()
        async for chunk in resp.chunks(first_timeout, self._t.idle, self._t.first_token):
            is_error = watch.feed(chunk)
            if not out.started:
                first_byte_came()
                call.timeline.decode_first_byte = time.perf_counter()
                if is_error and not is_last:
                    return DecodeFailed(Reply(200, resp.content_type, chunk))
                if (suspect := await self._suspect(call, decode, slot)) is not None:
                    return suspect
                await out.open_stream(resp.content_type)
                _close_handoff(slot, decode, 200)
            if is_error:
                # vLLM's event says only what failed; the client also learns where (error path only).
                chunk = protocol.with_error_event_origin(
                    chunk, f"decode instance {out.name_instances(decode.url)}"
                )
                if not out.has_error_event:
                    out.error_event_relayed("decode streamed an error event")
                    log.warning("request %s: decode %s streamed an error event", call.request_id, decode.url)
            if watch.has_done:
                await self._recheck_before_the_end(decode, slot)
            if progress is not None and not (chunk := progress.feed(chunk)):
                continue  # an event cut by the chunk's edge: the rest comes next (progress.py)
            await out.chunk(chunk)
            call.timeline.chunk(time.perf_counter())
        if not watch.has_done:
            # A stream that stops without [DONE] would look like a short answer to the client.
            raise UpstreamUnavailable("decode", decode.url, "stream ended before it was complete")
        await out.end()
        return Served()

    async def _recheck_before_the_end(self, decode: Instance, slot: HandoffSlot) -> None:
        """Prefill's log may have spoken since the stream began: a stream it discredits ends with an
        error naming the lease instead of a normal [DONE]."""
        delivered = slot.delivered
        why = self._guard.from_log(delivered) if delivered is not None else None
        if why is None:
            return
        slot.suspect("log_during_stream", why)
        await self._guard.purge(decode)
        raise UpstreamSuspectAnswer("decode", decode.url, f"KV lease: {why}; this answer may be wrong")


def _close_handoff(slot: HandoffSlot, decode: Instance, status: int) -> None:
    """Decode answered: its first bytes mean it has the KV; a 4xx means vLLM refused the request
    (a refusal in its handler also tells prefill to free the KV; one in its request validation leaves
    it to the lease)."""
    if status == 200:
        slot.deliver(decode.url)
    else:
        slot.abandon(f"decode {decode.url} answered {status}", "decode_rejected")


def _without_transfer_metadata(body: bytes) -> bytes:
    """Decode's whole answer less its ``kv_transfer_params``. vLLM prints compact JSON with that key
    after others, so cutting it out of the bytes is exact and skips parsing and re-encoding the whole
    answer (a quote inside a JSON string is escaped: no text can fake the key); any other shape is parsed."""
    spliced = body.replace(b',"kv_transfer_params":null', b"", 1)
    if len(spliced) < len(body) and b'"kv_transfer_params"' not in spliced:
        return spliced
    return protocol.without_transfer_metadata(body)
