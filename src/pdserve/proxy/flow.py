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

The lease guard (guard.py): decode's answer is held back until it is known not to rest on KV prefill
had already released; a suspect one is dropped and the request prefilled again (``LeaseSuspect``), at
most ``_MAX_LEASE_RETRIES`` times. Decodes whose streams wait long for a first byte are avoided. The
overall deadline (``Timeouts.request``) bounds every attempt, backoff and lease retry together. When
every instance of a role is out of service, the one most likely to answer is tried anyway (panic
mode): health checks, not single failures, decide who is out.

Each attempt returns a typed result (``Prefilled``/``Relayed``/``PrefillFailed``, ``Served``/
``DecodeFailed``); the ``Trace`` only records what happened, for /requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
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
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pdserve.protocol import Endpoint
from pdserve.proxy.guard import LeaseGuard
from pdserve.proxy.instance import Instance
from pdserve.proxy.ledger import Handoff
from pdserve.proxy.prefix import should_skip_prefill
from pdserve.proxy.responder import Responder
from pdserve.proxy.state import Outcome, ProxyState
from pdserve.proxy.timeline import Timeline
from pdserve.proxy.tokens import PromptTokenizer
from pdserve.proxy.trace import Trace
from pdserve.proxy.tracing import RequestTracing
from pdserve.proxy.upstream import Reply, Stream

log = logging.getLogger("pdserve.proxy")


@dataclass(frozen=True)
class Prompt:
    """What the proxy knows of a request's prompt, for prompt-aware routing and the skip rule."""

    num_tokens: int
    hashes: list[int]  # chained hashes of its full KV blocks (blocks.py)


_MAX_LEASE_RETRIES = 2
# A decode whose oldest stream has waited this share of the lease for a first byte is not stepping
# (stalled, or hopelessly queued): it gets no handoff while another can take it.
_LAGGING_SHARE = 1 / 3


@dataclass
class Call:
    """One client request as the attempts see it."""

    endpoint: Endpoint
    body: dict[str, Any]  # the client's body, kv_transfer_params removed
    headers: dict[str, str]  # for both instances: X-Request-Id, Authorization
    out: Responder
    trace: Trace
    is_stream: bool
    deadline: float  # monotonic: the request's overall limit (Timeouts.request)
    prompt: Prompt | None = None
    handoff: Handoff | None = None  # the KV handoff in play: opened by prefill, closed by decode
    delivered: Handoff | None = None  # the handoff decode's answer rests on, once it began
    has_error_event: bool = False  # decode streamed vLLM's error event to the client
    timeline: Timeline = field(default_factory=lambda: Timeline(time.perf_counter()))

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


@dataclass(frozen=True)
class LeaseSuspect:
    """Decode answered, but its answer may rest on released KV (guard.py): withheld, prefill again."""

    why: str


class Flow:
    def __init__(
        self,
        state: ProxyState,
        config: ProxyConfig,
        tokenizer: PromptTokenizer | None = None,
        tracing: RequestTracing | None = None,
    ) -> None:
        self._state = state
        self._config = config
        self._tokenizer = tokenizer
        self._t = config.timeouts
        self._guard = LeaseGuard(state, state.ledger)
        self._tracing = tracing

    async def serve(
        self,
        endpoint: Endpoint,
        raw: bytes,
        auth: str | None,
        out: Responder,
        arrived: float | None = None,
        arrived_ns: int | None = None,
    ) -> None:
        """Serve one request; ``arrived`` (perf_counter) and ``arrived_ns`` (epoch) mark when it came in,
        before it waited for an admission slot."""
        admitted = time.perf_counter()
        arrived = admitted if arrived is None else arrived
        arrived_ns = time.time_ns() if arrived_ns is None else arrived_ns
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
        call = Call(endpoint, body, headers, out, trace, is_stream, time.monotonic() + self._t.request)
        timeline = call.timeline = Timeline(arrived, admitted, itl=self._state.stats.timings.itl)
        span = None
        if self._tracing is not None:
            span = self._tracing.start(out.request_id, endpoint, is_stream, arrived_ns)
            self._tracing.inject(span, headers)  # so vLLM's spans join this request's trace
            trace.trace_id = f"{span.get_span_context().trace_id:032x}"
        begun = time.perf_counter()
        try:
            await self._serve(call)
        except UpstreamError as exc:
            trace.error = str(exc)
            log.warning("request %s failed: %s", out.request_id, exc)
            retry_after = getattr(exc, "retry_after_s", None)
            extra = [(b"retry-after", str(retry_after).encode())] if retry_after else []
            await out.error(exc.status, str(exc), exc.error_type, extra=extra)
        finally:
            timeline.ended = time.perf_counter()
            trace.total_ms = (timeline.ended - begun) * 1000
            trace.timeline = timeline.as_ms()
            self._state.stats.timed(timeline)
            outcome = self._outcome(call)
            if outcome is Outcome.CLIENT_DISCONNECTED and trace.error is None:
                trace.error = "client disconnected"
            trace.outcome = outcome.value
            self._state.stats.finished(endpoint, outcome)
            if call.handoff is not None:  # still open: decode never started answering
                kind = "client_gone" if outcome is Outcome.CLIENT_DISCONNECTED else "failed"
                self._state.ledger.abandon(call.handoff, trace.error or "request ended", kind)
            if span is not None and self._tracing is not None:
                attributes = {"pdserve.outcome": outcome.value, "pdserve.prefill_url": trace.prefill_url,
                              "pdserve.decode_url": trace.decode_url, "http.response.status_code": out.status,
                              "pdserve.retries": len(trace.retries)}  # fmt: skip
                self._tracing.finish(span, timeline, arrived_ns, attributes, trace.error)

    async def _serve(self, call: Call) -> None:
        local_reason = (
            "colocated: no split" if self._config.colocated else protocol.needs_local_prefill(call.body)
        )
        call.prompt = self._prompt(call.body)
        tried: list[Instance] = []  # decodes that failed (or were given up on): a retry goes elsewhere
        num_failed = num_lease_retries = 0
        while True:
            decode, num_cached = self._pick_decode(tried, call.prompt)
            if not tried and num_lease_retries == 0 and local_reason is None:
                local_reason = self._skip_reason(call.prompt, num_cached)
            if local_reason is None and call.handoff is None:
                prefilled = await self._prefill(call)
                if isinstance(prefilled, Relayed):
                    return
                if isinstance(prefilled, PrefillFailed):
                    if not self._config.fallback_to_local_prefill:
                        await self._give_up("prefill", call.trace.prefill_url or "-", prefilled.failure, call)
                        return
                    local_reason = (
                        f"prefill failed ({_describe(prefilled.failure)}); decode computes the prompt"
                    )
                    log.warning("request %s: %s", call.request_id, local_reason)
                else:
                    call.handoff = prefilled.handoff
            call.trace.local_prefill_reason = local_reason
            # A retry goes to another instance: none left (or no attempts left) makes this the last.
            others = self._state.pool("decode").available([*tried, decode])
            is_last = num_failed + 1 >= self._config.max_decode_attempts or not others
            decoded = await self._decode(call, decode, is_last)
            if isinstance(decoded, Served):
                return
            if isinstance(decoded, LeaseSuspect):
                num_lease_retries += 1
                call.trace.retries.append(f"decode {decode.url}: {decoded.why}; prefilling again")
                self._state.stats.retried("lease")
                if num_lease_retries > _MAX_LEASE_RETRIES:
                    raise UpstreamUnavailable("decode", decode.url, f"KV lease: {decoded.why} "
                                              f"(and after {_MAX_LEASE_RETRIES} fresh prefills)")  # fmt: skip
                if others:
                    tried.append(decode)  # it may be the reason (stalled): let another take the next one
                continue
            num_failed += 1
            tried.append(decode)
            if is_last:
                await self._give_up("decode", decode.url, decoded.failure, call)
                return
            call.trace.retries.append(f"decode {decode.url}: {_describe(decoded.failure)}")
            self._state.stats.retried("decode")
            if call.handoff is not None and not self._may_reuse(call.handoff, decoded):
                self._state.ledger.abandon(call.handoff, f"decode {decode.url}: {_describe(decoded.failure)}",
                                           "decode_failed")  # fmt: skip
                call.handoff = None  # decode may have pulled, and prefill freed, those blocks: prefill again
            await self._sleep(call, self._backoff(num_failed))

    def _limit(self, call: Call, phase: str, url: str, limit: float) -> float:
        """The time an attempt may take: its phase's limit, or what is left of the request's deadline."""
        left = call.deadline - time.monotonic()
        if left <= 0:
            raise UpstreamTimeout(phase, url, f"the request's {self._t.request:g} s deadline passed")
        return min(limit, left)

    async def _sleep(self, call: Call, seconds: float) -> None:
        await asyncio.sleep(min(seconds, max(0.0, call.deadline - time.monotonic())))

    def _check_deadline(self, call: Call, exc: UpstreamTimeout) -> UpstreamTimeout:
        """A timeout that the deadline, not the phase's own limit, caused says so."""
        if time.monotonic() >= call.deadline - 0.01:
            return UpstreamTimeout(exc.phase, exc.url, f"the request's {self._t.request:g} s deadline passed")
        return exc

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
        if candidates:
            return candidates
        # Panic mode: every instance is out of service, by health checks or circuits. Refusing everyone
        # would turn a flap (a busy machine, one slow check) into an outage; the instance likeliest to
        # answer gets the request, and its answer feeds its breaker as usual.
        now = time.monotonic()
        fallbacks = [i for i in pool.instances if i.is_panic_candidate and i not in tried]
        if fallbacks:
            best = min(fallbacks, key=lambda i: i.failure_score)
            self._state.stats.panicked(role)
            log.warning(
                "no %s instance in service; trying %s (%s)", role, best.url, best.why_unavailable(now)
            )
            return [best]
        states = ", ".join(f"{i.url} ({i.why_unavailable(now)})" for i in pool.instances)
        raise NoInstanceAvailable(role, states or "none configured")

    def _pick_decode(self, tried: Sequence[Instance], prompt: Prompt | None) -> tuple[Instance, int]:
        """A decode instance and how many of the prompt's tokens it likely holds in its prefix cache.

        Decodes whose oldest stream has waited long for its first byte are left out while others can
        serve: a handoff sent there may outwait prefill's lease."""
        candidates = self._candidates("decode", tried)
        now, limit = time.monotonic(), self._config.kv_lease_s * _LAGGING_SHARE
        stepping = [c for c in candidates if c.first_byte_wait_s(now) < limit]
        hashes = prompt.hashes if prompt is not None else None
        pick = self._state.policy("decode").pick(stepping or candidates, hashes)
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
                await self._sleep(call, self._backoff(attempt - 1))
            try:
                prefill = self._pick_prefill(tried, call.prompt)
            except NoInstanceAvailable as exc:
                failure = exc  # none in service (e.g. the only one restarting): a fallback may still serve
                break
            tried.append(prefill)
            trace.prefill_url = prefill.url
            begun = time.perf_counter()
            try:
                limit = self._limit(call, "prefill", prefill.url, self._t.prefill)
                call.timeline.prefill_sent = time.perf_counter()
                with prefill.dispatched():
                    # A prefill sent twice costs only compute: a stale keep-alive connection is retried.
                    reply = await prefill.upstream.post(
                        call.path, payload, call.headers, "prefill", limit, is_repeatable=True
                    )
                call.timeline.prefill_done = time.perf_counter()
                trace.prefill_ms = (call.timeline.prefill_done - begun) * 1000
                trace.prefill_status = reply.status
                if reply.status == 200:
                    try:
                        params = protocol.kv_params_from_prefill(reply.body)
                    except ValueError as exc:
                        raise UpstreamProtocolError("prefill", prefill.url, str(exc)) from None
                    prefill.succeeded()
                    trace.kv_transfer_params = params
                    ledger = self._state.ledger
                    return Prefilled(
                        ledger.open(call.request_id, prefill.url, params, prefill.num_kv_expired)
                    )
                if reply.status < 500:  # the client's own mistake: no other instance would differ
                    prefill.succeeded()
                    await _relay_rejection("prefill", prefill.url, reply, call)
                    return Relayed()
                prefill.failed(f"answered {reply.status}")
                failure = reply
            except UpstreamTimeout as exc:
                prefill.failed(exc.detail, is_slow=True)
                failure = self._check_deadline(call, exc)
            except UpstreamError as exc:
                prefill.failed(exc.detail, is_slow=exc.is_slow)
                failure = exc
            trace.retries.append(f"prefill {prefill.url}: {_describe(failure)}")
            if time.monotonic() >= call.deadline:
                break
        assert failure is not None
        return PrefillFailed(failure)

    # --- decode -----------------------------------------------------------------------------------

    async def _decode(
        self, call: Call, decode: Instance, is_last: bool
    ) -> Served | DecodeFailed | LeaseSuspect:
        """Serve the client from ``decode``; a failure before the client's first byte is returned,
        unrelayed, so that another attempt may follow."""
        call.trace.decode_url = decode.url
        handoff = call.handoff
        payload = orjson.dumps(protocol.decode_body(call.body, handoff.params) if handoff else call.body)
        call.timeline.decode_sent = time.perf_counter()
        with decode.dispatched():
            try:
                if call.is_stream:
                    result = await self._decode_stream(call, decode, payload, is_last)
                else:
                    result = await self._decode_whole(call, decode, payload)
            except UpstreamError as exc:
                decode.failed(exc.detail, is_slow=exc.is_slow)
                if isinstance(exc, UpstreamTimeout):
                    exc = self._check_deadline(call, exc)
                if call.out.started:
                    raise exc from None
                return DecodeFailed(exc, kv_unused=isinstance(exc, UpstreamConnectError))
        if isinstance(result, DecodeFailed):
            failure = result.failure
            decode.failed(failure.detail if isinstance(failure, UpstreamError) else _instance_error(failure))
        elif call.has_error_event:
            decode.failed("streamed an error event")
        else:
            decode.succeeded()
        return result

    async def _suspect(self, call: Call) -> LeaseSuspect | None:
        """The lease guard's verdict on decode's answer, which is about to begin; the handoff of a
        suspect one is closed as such."""
        handoff = call.handoff
        if handoff is None:
            return None
        suspicion = await self._guard.check(handoff)
        if suspicion is None:
            return None
        log.warning("request %s: not relaying decode's answer: %s", call.request_id, suspicion.why)
        self._state.ledger.mark_suspect(handoff, suspicion.kind, suspicion.why)
        call.handoff = None
        return LeaseSuspect(suspicion.why)

    async def _decode_whole(
        self, call: Call, decode: Instance, payload: bytes
    ) -> Served | DecodeFailed | LeaseSuspect:
        limit = self._limit(call, "decode", decode.url, self._t.decode)
        reply = await decode.upstream.post(call.path, payload, call.headers, "decode", limit)
        call.timeline.decode_first_byte = time.perf_counter()
        call.trace.decode_status = reply.status
        if reply.status >= 500:
            return DecodeFailed(reply)
        if reply.status == 200 and (suspect := await self._suspect(call)) is not None:
            return suspect
        self._close_handoff(call, decode, reply.status)
        if reply.status != 200:
            await _relay_rejection("decode", decode.url, reply, call)
        else:
            await call.out.relay(200, reply.content_type, _without_transfer_metadata(reply.body))
        call.timeline.chunk(time.perf_counter())
        return Served()

    async def _decode_stream(
        self, call: Call, decode: Instance, payload: bytes, is_last: bool
    ) -> Served | DecodeFailed | LeaseSuspect:
        # The first chunk's budget is what the status line left of first_token, not a fresh one.
        first_token = self._limit(call, "decode", decode.url, self._t.first_token)
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
                    self._close_handoff(call, decode, resp.status)
                    await _relay_rejection("decode", decode.url, reply, call)
                    return Served()
                first_timeout = max(0.0, first_chunk_deadline - time.monotonic())
                return await self._relay(call, resp, decode, first_timeout, is_last, first_byte_came)

    async def _relay(
        self,
        call: Call,
        resp: Stream,
        decode: Instance,
        first_timeout: float,
        is_last: bool,
        first_byte_came: Callable[[], None],
    ) -> Served | DecodeFailed | LeaseSuspect:
        """Forward decode's SSE bytes untouched, watching only for vLLM's error event and [DONE].

        The client's stream starts with the first chunk, not before: an error event as the very
        first thing (e.g. the KV pull failed) can still be retried elsewhere unless this is the last
        try, and the lease guard has its say before any byte goes out.
        """
        out = call.out
        watch = sse.StreamWatch()
        async for chunk in resp.chunks(first_timeout, self._t.idle, self._t.first_token):
            is_error = watch.feed(chunk)
            if not out.started:
                first_byte_came()
                call.timeline.decode_first_byte = time.perf_counter()
                if is_error and not is_last:
                    return DecodeFailed(Reply(200, resp.content_type, chunk))
                if (suspect := await self._suspect(call)) is not None:
                    return suspect
                await out.open_stream(resp.content_type)
                self._close_handoff(call, decode, 200)
            if is_error:
                # vLLM's event says only what failed; the client also learns where (error path only).
                chunk = protocol.with_error_event_origin(chunk, f"decode instance {decode.url}")
                if not call.has_error_event:
                    call.has_error_event = call.trace.stream_error_event = True
                    call.trace.error = "decode streamed an error event"
                    log.warning("request %s: decode %s streamed an error event", call.request_id, decode.url)
            if watch.has_done:
                self._recheck_before_the_end(call, decode)
            await out.chunk(chunk)
            call.timeline.chunk(time.perf_counter())
        if not watch.has_done:
            # A stream that stops without [DONE] would look like a short answer to the client.
            raise UpstreamUnavailable("decode", decode.url, "stream ended before it was complete")
        await out.end()
        return Served()

    def _recheck_before_the_end(self, call: Call, decode: Instance) -> None:
        """Prefill's log may have spoken since the stream began: a stream it discredits ends with an
        error naming the lease instead of a normal [DONE]."""
        delivered = call.delivered
        why = self._guard.from_log(delivered) if delivered is not None else None
        if delivered is None or why is None:
            return
        self._state.ledger.mark_suspect(delivered, "log_during_stream", why)
        raise UpstreamUnavailable("decode", decode.url, f"KV lease: {why}; this answer may be wrong")

    def _close_handoff(self, call: Call, decode: Instance, status: int) -> None:
        """Decode answered: its first bytes mean it has the KV; a 4xx means vLLM refused the request
        (a refusal in its handler also tells prefill to free the KV; one in its request validation leaves
        it to the lease)."""
        if call.handoff is None:
            return
        if status == 200:
            self._state.ledger.delivered(call.handoff, decode.url)
            call.delivered = call.handoff
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


def _without_transfer_metadata(body: bytes) -> bytes:
    """Decode's whole answer less its ``kv_transfer_params``. vLLM prints compact JSON with that key
    after others, so cutting it out of the bytes is exact and skips parsing and re-encoding the whole
    answer (a quote inside a JSON string is escaped: no text can fake the key); any other shape is parsed."""
    spliced = body.replace(b',"kv_transfer_params":null', b"", 1)
    if len(spliced) < len(body) and b'"kv_transfer_params"' not in spliced:
        return spliced
    return protocol.without_transfer_metadata(body)


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
