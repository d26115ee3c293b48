"""A request's path through the proxy, top to bottom.

    parse → can it be split? → prompt tokens (if a policy or the skip rule wants them)
          → pick decode (first: what it caches decides whether prefill is worth a hop)
          → pick prefill → prefill (max_tokens=1, do_remote_decode) → kv_transfer_params: a handoff
          → decode (client's own request + params; decode pulls the KV over NIXL, not via us)
          → relay decode's answer to the client

The KV cache never passes through here: only its address (``kv_transfer_params``) does. Every way a
call can fail ends the client's request with an error naming the phase and instance; vLLM's own
rejections (4xx, 5xx) reach the client with vLLM's status and body.

Retries, before the client has received a byte:
- prefill fails (connect, timeout, 5xx, no params) → another prefill instance, with backoff; when all
  attempts fail, decode computes the prompt itself if ``fallback_to_local_prefill`` is on.
- decode fails before its first byte → another decode instance. Prefill's params are reused only when
  the failed decode never received them (connect error) and are younger than half the lease: a decode
  that did receive them may have pulled the blocks, which prefill then frees, and a second pull of
  freed blocks is not detected by vLLM (observed on 0.32: it "succeeds" and reads whatever is there).
Once the client has bytes, a failure ends the stream with an error event; nothing is retried.

Each attempt returns a typed result (``Prefilled``/``Relayed``/``PrefillFailed``, ``Served``/
``DecodeFailed``); the ``Trace`` only records what happened, for /requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdserve import protocol, sse
from pdserve.blocks import block_hashes
from pdserve.config import ProxyConfig, Role
from pdserve.errors import (
    BadRequest,
    NoInstanceAvailable,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamUnavailable,
)
from pdserve.protocol import Endpoint
from pdserve.proxy.instance import Instance
from pdserve.proxy.ledger import Handoff
from pdserve.proxy.prefix import should_skip_prefill
from pdserve.proxy.responder import Responder
from pdserve.proxy.state import Outcome, ProxyState
from pdserve.proxy.tokens import PromptTokenizer
from pdserve.proxy.trace import Trace
from pdserve.proxy.upstream import Reply, Stream

log = logging.getLogger("pdserve.proxy")


@dataclass(frozen=True)
class Prompt:
    """What the proxy knows of a request's prompt, for prompt-aware routing and the skip rule."""

    num_tokens: int
    hashes: list[int]  # chained hashes of its full KV blocks (blocks.py)


@dataclass
class Call:
    """One client request as the attempts see it."""

    endpoint: Endpoint
    body: dict[str, Any]  # the client's body, kv_transfer_params removed
    headers: dict[str, str]  # for both instances: X-Request-Id, Authorization
    out: Responder
    trace: Trace
    is_stream: bool
    prompt: Prompt | None = None
    handoff: Handoff | None = None  # the KV handoff in play: opened by prefill, closed by decode
    has_error_event: bool = False  # decode streamed vLLM's error event to the client

    @property
    def path(self) -> str:
        return protocol.PATHS[self.endpoint]

    @property
    def request_id(self) -> str:
        return self.out.request_id


# What an attempt came to. A prefill attempt: the KV is ready, or the client already has vLLM's own
# rejection, or it failed. A decode attempt: the client was served (or given vLLM's rejection), or it
# failed before the client got a byte.
@dataclass(frozen=True)
class Prefilled:
    handoff: Handoff


@dataclass(frozen=True)
class Relayed:
    """The client already has its answer: an instance's own rejection, relayed."""


@dataclass(frozen=True)
class PrefillFailed:
    failure: UpstreamError | Reply  # the last attempt's error, or its 5xx answer


@dataclass(frozen=True)
class Served:
    """The client got decode's answer (or decode's own 4xx)."""


@dataclass(frozen=True)
class DecodeFailed:
    failure: UpstreamError | Reply  # a 5xx answer, or a stream whose first event was an error
    kv_unused: bool = field(default=False)  # the request never reached decode: its params are unread


class Flow:
    def __init__(
        self, state: ProxyState, config: ProxyConfig, tokenizer: PromptTokenizer | None = None
    ) -> None:
        self._state = state
        self._config = config
        self._tokenizer = tokenizer
        self._t = config.timeouts

    async def serve(self, endpoint: Endpoint, raw: bytes, auth: str | None, out: Responder) -> None:
        try:
            body = protocol.client_body(protocol.parse_body(raw))
        except BadRequest as exc:
            await out.error(400, exc.message, "BadRequestError", exc.param)
            self._state.stats.finished(endpoint, Outcome.CLIENT_ERROR)
            return
        is_stream = body.get("stream") is True
        trace = Trace(out.request_id, endpoint, stream=is_stream)
        self._state.record(trace)
        headers = {"X-Request-Id": out.request_id}
        if auth is not None:
            headers["Authorization"] = auth
        call = Call(endpoint, body, headers, out, trace, is_stream)
        begun = time.perf_counter()
        try:
            await self._serve(call)
        except UpstreamError as exc:
            trace.error = str(exc)
            log.warning("request %s failed: %s", out.request_id, exc)
            await out.error(exc.status, str(exc), exc.error_type)
        finally:
            trace.total_ms = (time.perf_counter() - begun) * 1000
            outcome = self._outcome(call)
            if outcome is Outcome.CLIENT_DISCONNECTED and trace.error is None:
                trace.error = "client disconnected"
            trace.outcome = outcome.value
            self._state.stats.finished(endpoint, outcome)
            if call.handoff is not None:  # still open: decode never started answering
                kind = "client_gone" if outcome is Outcome.CLIENT_DISCONNECTED else "failed"
                self._state.ledger.abandon(call.handoff, trace.error or "request ended", kind)

    async def _serve(self, call: Call) -> None:
        local_reason = protocol.needs_local_prefill(call.body)
        call.prompt = self._prompt(call.body)
        tried: list[Instance] = []
        for attempt in range(1, self._config.max_decode_attempts + 1):
            decode, num_cached = self._pick_decode(tried, call.prompt)
            tried.append(decode)
            if attempt == 1 and local_reason is None:
                local_reason = self._skip_reason(call.prompt, num_cached)
            if local_reason is None and call.handoff is None:
                prefilled = await self._prefill(call)
                if isinstance(prefilled, Relayed):
                    return
                if isinstance(prefilled, PrefillFailed):
                    if not self._config.fallback_to_local_prefill:
                        await self._give_up("prefill", call.trace.prefill_url or "-", prefilled.failure, call)
                        return
                    local_reason = f"prefill failed ({call.trace.retries[-1]}); decode computes the prompt"
                    log.warning("request %s: %s", call.request_id, local_reason)
                else:
                    call.handoff = prefilled.handoff
            call.trace.local_prefill_reason = local_reason
            # A retry goes to another instance: none left (or no attempts left) makes this the last.
            is_last = attempt == self._config.max_decode_attempts or not self._state.pool("decode").available(
                tried
            )
            decoded = await self._decode(call, decode, is_last)
            if isinstance(decoded, Served):
                return
            if is_last:
                await self._give_up("decode", decode.url, decoded.failure, call)
                return
            call.trace.retries.append(f"decode {decode.url}: {_describe(decoded.failure)}")
            self._state.stats.retried("decode")
            if call.handoff is not None and not self._may_reuse(call.handoff, decoded):
                self._state.ledger.abandon(call.handoff, f"decode {decode.url}: {_describe(decoded.failure)}",
                                           "decode_failed")  # fmt: skip
                call.handoff = None  # decode may have pulled, and prefill freed, those blocks: prefill again
            await asyncio.sleep(self._backoff(attempt))

    @staticmethod
    def _may_reuse(handoff: Handoff, decoded: DecodeFailed) -> bool:
        """Prefill's params may go to the next decode only if the failed one never read them and they
        leave the next one time to start its pull before the lease runs out."""
        return decoded.kv_unused and handoff.is_fresh()

    # --- choosing ---------------------------------------------------------------------------------

    def _prompt(self, body: dict[str, Any]) -> Prompt | None:
        """The prompt's tokens and block hashes, when a policy or the skip rule needs them."""
        state = self._state
        wants = state.policy("prefill").wants_prompt or state.policy("decode").wants_prompt
        if self._tokenizer is None or not (wants or self._config.skip_prefill_below_tokens):
            return None
        ids = self._tokenizer.token_ids(body)
        if ids is None:
            return None
        salt = body.get("cache_salt")
        hashes = block_hashes(ids, self._config.prefix_block_size, salt if isinstance(salt, str) else None)
        return Prompt(len(ids), hashes)

    def _skip_reason(self, prompt: Prompt | None, num_cached: int) -> str | None:
        """Why decode should compute this prompt itself (conditional disaggregation), or None."""
        threshold = self._config.skip_prefill_below_tokens
        if prompt is None or not should_skip_prefill(prompt.num_tokens, num_cached, threshold):
            return None
        return f"{prompt.num_tokens - num_cached} uncached prompt tokens < {threshold}"

    def _candidates(self, role: Role, tried: Sequence[Instance]) -> list[Instance]:
        pool = self._state.pool(role)
        candidates = pool.available(exclude=tried)
        if not candidates:
            now = time.monotonic()
            states = ", ".join(f"{i.url} ({i.why_unavailable(now)})" for i in pool.instances)
            raise NoInstanceAvailable(role, states or "none configured")
        return candidates

    def _pick_decode(self, tried: Sequence[Instance], prompt: Prompt | None) -> tuple[Instance, int]:
        """A decode instance and how many of the prompt's tokens it likely holds in its prefix cache."""
        hashes = prompt.hashes if prompt is not None else None
        pick = self._state.policy("decode").pick(self._candidates("decode", tried), hashes)
        return pick.instance, pick.num_cached_tokens

    def _pick_prefill(self, tried: Sequence[Instance], prompt: Prompt | None) -> Instance:
        hashes = prompt.hashes if prompt is not None else None
        return self._state.policy("prefill").pick(self._candidates("prefill", tried), hashes).instance

    def _backoff(self, attempt: int) -> float:
        return float(min(1.0, self._config.retry_backoff_s * 2 ** (attempt - 1)))

    # --- prefill ----------------------------------------------------------------------------------

    async def _prefill(self, call: Call) -> Prefilled | Relayed | PrefillFailed:
        payload = orjson.dumps(protocol.prefill_body(call.body))
        trace = call.trace
        tried: list[Instance] = []
        failure: UpstreamError | Reply | None = None
        for attempt in range(1, self._config.max_prefill_attempts + 1):
            if attempt > 1:
                if not self._state.pool("prefill").available(tried):
                    break  # a retry goes to another instance, and there is none
                self._state.stats.retried("prefill")
                await asyncio.sleep(self._backoff(attempt - 1))
            prefill = self._pick_prefill(tried, call.prompt)
            tried.append(prefill)
            trace.prefill_url = prefill.url
            begun = time.perf_counter()
            try:
                with prefill.dispatched():
                    reply = await prefill.upstream.post(
                        call.path, payload, call.headers, "prefill", self._t.prefill
                    )
                trace.prefill_ms = (time.perf_counter() - begun) * 1000
                trace.prefill_status = reply.status
                if reply.status == 200:
                    try:
                        params = protocol.kv_params_from_prefill(reply.body)
                    except ValueError as exc:
                        raise UpstreamProtocolError("prefill", prefill.url, str(exc)) from None
                    prefill.succeeded()
                    trace.kv_transfer_params = params
                    return Prefilled(self._state.ledger.open(call.request_id, prefill.url, params))
                if reply.status < 500:  # the client's own mistake: no other instance would differ
                    prefill.succeeded()
                    await _relay_rejection("prefill", prefill.url, reply, call)
                    return Relayed()
                prefill.failed(f"answered {reply.status}")
                failure = reply
            except UpstreamError as exc:
                prefill.failed(exc.detail)
                failure = exc
            trace.retries.append(f"prefill {prefill.url}: {_describe(failure)}")
        assert failure is not None
        return PrefillFailed(failure)

    # --- decode -----------------------------------------------------------------------------------

    async def _decode(self, call: Call, decode: Instance, is_last: bool) -> Served | DecodeFailed:
        """Serve the client from ``decode``; a failure before the client's first byte is returned,
        unrelayed, so that another attempt may follow."""
        call.trace.decode_url = decode.url
        handoff = call.handoff
        payload = orjson.dumps(protocol.decode_body(call.body, handoff.params) if handoff else call.body)
        with decode.dispatched():
            try:
                if call.is_stream:
                    result = await self._decode_stream(call, decode, payload, is_last)
                else:
                    result = await self._decode_whole(call, decode, payload)
            except UpstreamError as exc:
                decode.failed(exc.detail)
                if call.out.started:
                    raise
                return DecodeFailed(exc, kv_unused=isinstance(exc, UpstreamConnectError))
        if isinstance(result, DecodeFailed):
            failure = result.failure
            decode.failed(failure.detail if isinstance(failure, UpstreamError) else _instance_error(failure))
        elif call.has_error_event:
            decode.failed("streamed an error event")
        else:
            decode.succeeded()
        return result

    async def _decode_whole(self, call: Call, decode: Instance, payload: bytes) -> Served | DecodeFailed:
        reply = await decode.upstream.post(call.path, payload, call.headers, "decode", self._t.decode)
        call.trace.decode_status = reply.status
        if reply.status >= 500:
            return DecodeFailed(reply)
        self._close_handoff(call, decode, reply.status)
        if reply.status != 200:
            await _relay_rejection("decode", decode.url, reply, call)
        else:
            await call.out.relay(200, reply.content_type, protocol.without_transfer_metadata(reply.body))
        return Served()

    async def _decode_stream(
        self, call: Call, decode: Instance, payload: bytes, is_last: bool
    ) -> Served | DecodeFailed:
        # The first chunk's budget is what the status line left of first_token, not a fresh one.
        first_chunk_deadline = time.monotonic() + self._t.first_token
        async with decode.upstream.open_stream(
            call.path, payload, call.headers, "decode", self._t.first_token
        ) as resp:
            call.trace.decode_status = resp.status
            if resp.status != 200:
                reply = Reply(resp.status, resp.content_type, await resp.read_all(self._t.idle))
                if resp.status >= 500:
                    return DecodeFailed(reply)
                self._close_handoff(call, decode, resp.status)
                await _relay_rejection("decode", decode.url, reply, call)
                return Served()
            first_timeout = max(0.0, first_chunk_deadline - time.monotonic())
            return await self._relay(call, resp, decode, first_timeout, is_last)

    async def _relay(
        self, call: Call, resp: Stream, decode: Instance, first_timeout: float, is_last: bool
    ) -> Served | DecodeFailed:
        """Forward decode's SSE bytes untouched, watching only for vLLM's error event and [DONE].

        The client's stream starts with the first chunk, not before: an error event as the very
        first thing (e.g. the KV pull failed) can still be retried elsewhere unless this is the last try.
        """
        out = call.out
        watch = sse.StreamWatch()
        async for chunk in resp.chunks(first_timeout, self._t.idle, self._t.first_token):
            is_error = watch.feed(chunk)
            if not out.started:
                if is_error and not is_last:
                    return DecodeFailed(Reply(200, resp.content_type, chunk))
                await out.open_stream(resp.content_type)
                self._close_handoff(call, decode, 200)
            if is_error:
                # vLLM's event says only what failed; the client also learns where (error path only).
                chunk = protocol.with_error_event_origin(chunk, f"decode instance {decode.url}")
                if not call.has_error_event:
                    call.has_error_event = call.trace.stream_error_event = True
                    call.trace.error = "decode streamed an error event"
                    log.warning("request %s: decode %s streamed an error event", call.request_id, decode.url)
            await out.chunk(chunk)
        if not watch.has_done:
            # A stream that stops without [DONE] would look like a short answer to the client.
            raise UpstreamUnavailable("decode", decode.url, "stream ended before it was complete")
        await out.end()
        return Served()

    def _close_handoff(self, call: Call, decode: Instance, status: int) -> None:
        """Decode answered: its first bytes mean it has the KV; a 4xx means vLLM refused the request
        (a refusal in its handler also tells prefill to free the KV; one in its request validation leaves
        it to the lease)."""
        if call.handoff is None:
            return
        if status == 200:
            self._state.ledger.delivered(call.handoff, decode.url)
        else:
            self._state.ledger.abandon(
                call.handoff, f"decode {decode.url} answered {status}", "decode_rejected"
            )
        call.handoff = None

    async def _give_up(self, phase: str, url: str, failure: UpstreamError | Reply, call: Call) -> None:
        """The last attempt of ``phase`` failed: the client hears of that failure."""
        if isinstance(failure, UpstreamError):
            raise failure
        await _relay_rejection(phase, url, failure, call)

    def _outcome(self, call: Call) -> Outcome:
        out = call.out
        if not out.finished and call.trace.error in (None, "client disconnected"):
            return Outcome.CLIENT_DISCONNECTED
        if call.has_error_event or (out.status == 200 and call.trace.error is not None):
            return Outcome.STREAM_ERROR
        code = out.status or 0
        return Outcome.OK if code == 200 else Outcome.CLIENT_ERROR if code < 500 else Outcome.ERROR


def _instance_error(reply: Reply) -> str:
    return "streamed an error event" if reply.status == 200 else f"answered {reply.status}"


def _describe(failure: UpstreamError | Reply) -> str:
    if isinstance(failure, Reply):
        return "streamed an error event first" if failure.status == 200 else f"answered {failure.status}"
    return failure.detail


async def _relay_rejection(phase: str, url: str, reply: Reply, call: Call) -> None:
    """An instance's non-200 answer goes to the client with its status; a 5xx also names who failed."""
    call.trace.error = f"{phase} answered {reply.status}"
    body = reply.body
    if reply.status >= 500:
        body = protocol.with_error_origin(body, f"{phase} instance {url}")
    await call.out.relay(reply.status, reply.content_type, body)
