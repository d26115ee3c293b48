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
  attempts fail or none is in service, decode computes the prompt itself (``fallback_to_local_prefill``,
  on by default).
- no decode in service (all restarting, unhealthy past panic mode, draining) → a prefill instance serves
  the request whole (``Chooser.stand_in``): a 503 only when no instance of either role can take it.
- decode fails before its first byte → another decode instance. Prefill's params are reused only when
  the failed decode never received them (connect error) and are younger than half the lease: a decode
  that did receive them may have pulled the blocks, which prefill then frees, and a second pull of
  freed blocks is not detected by vLLM (observed on 0.32: it "succeeds" and reads whatever is there).
- the last decode answered a split request with a 5xx or an error event before any token → that decode
  once more, computing the prompt itself: most often its KV pull failed because the prefill holding the
  KV died (``survivors.computes_itself``); only then may a prefill stand in (``survivors.stand_in``).
- a kept-alive connection decode had closed before answering → the same decode once more, not the
  chooser's next pick, under a fresh prefill (``_once_more_on_a_fresh_connection`` says why); a second
  such loss counts as a failed attempt, as above.
Once the client has bytes, a stream whose decode fails goes on from another instance (migrate.py), or,
where it cannot, ends with an error event.

The lease guard (guard.py): decode's answer is held back until it is known not to rest on KV prefill
had already released; a suspect one is dropped and the request prefilled again (``LeaseSuspect``), at
most ``_MAX_LEASE_RETRIES`` times, under a fresh ``cache_salt``: the late pull's wrong blocks stay in
decode's prefix cache under the prompt's hashes, and the redo must not match them.
The overall deadline (``Timeouts.request``) bounds every attempt, backoff and lease retry together.

Who takes each attempt (choice.py): the role's policy over the instances in service, decodes that show
no sign of stepping left out, and panic mode when a whole role is out of service. Each attempt returns
a typed result (attempt.py: ``Prefilled``/``Relayed``/``PrefillFailed``, ``Served``/``DecodeFailed``/
``LeaseSuspect``) and the decisions are taken here, from those; the prefill attempts live in
prefill.py, the decode attempt and its relay in decode.py. The request's handoff moves only through its
``HandoffSlot`` (opened here, closed by decode as its answer begins, checked here at the end); what the
client was told went wrong is the ``Responder``'s; the ``Trace`` only records, for /requests.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any

from pdserve import protocol
from pdserve.blocks import block_hashes
from pdserve.config import ProxyConfig
from pdserve.errors import (
    BadRequest,
    NoInstanceAvailable,
    UpstreamError,
    UpstreamUnavailable,
)
from pdserve.protocol import Endpoint
from pdserve.proxy.attempt import (
    Call,
    DecodeFailed,
    HandoffSlot,
    LeaseSuspect,
    PrefillFailed,
    Prompt,
    Relayed,
    Served,
    describe,
    relay_rejection,
)
from pdserve.proxy.choice import Chooser
from pdserve.proxy.decode import Decoder
from pdserve.proxy.guard import LeaseGuard
from pdserve.proxy.holding import Hold
from pdserve.proxy.instance import Instance
from pdserve.proxy.ledger import Handoff
from pdserve.proxy.migrate import Migrator
from pdserve.proxy.otel import RequestTracing
from pdserve.proxy.placing import Placed, place
from pdserve.proxy.prefill import Prefiller
from pdserve.proxy.prefix import should_skip_prefill
from pdserve.proxy.record import Trace
from pdserve.proxy.release import Releaser
from pdserve.proxy.responder import Responder
from pdserve.proxy.state import Outcome, ProxyState
from pdserve.proxy.survivors import DecodeTries, computes_itself, elastic_retry, may_compute_itself, stand_in
from pdserve.proxy.timeline import Timeline
from pdserve.proxy.tokens import PromptTokenizer
from pdserve.proxy.upstream import Reply
from pdserve.proxy.validation import FieldErrors, check_before_prefill
from pdserve.proxy.wholeon import serve_whole_on

log = logging.getLogger("pdserve.proxy")


_MAX_LEASE_RETRIES = 2


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
        self._chooser = Chooser(state, config)
        self._prefiller = Prefiller(state, config, self._chooser)
        self._decoder = Decoder(config, LeaseGuard(state, state.ledger))
        self._releaser = Releaser(state, config.kv_lease_s)
        self._migrator = Migrator(state, config.retries, config.timeouts.decode)
        self._tracing = tracing
        # decode's context length (its /v1/models), once known: max_tokens beyond it is refused up front
        self.max_model_len: int | None = None

    async def serve(
        self,
        endpoint: Endpoint,
        raw: bytes,
        auth: str | None,
        out: Responder,
        arrived: float | None = None,
        arrived_ns: int | None = None,
        whole_on: Instance | None = None,
    ) -> None:
        """Serve one request; ``arrived`` (perf_counter) and ``arrived_ns`` (epoch) mark when it came in,
        before it waited for an admission slot. ``whole_on``: the admin asked for that instance's whole
        answer (wholeon.py)."""
        admitted = time.perf_counter()
        arrived = admitted if arrived is None else arrived
        arrived_ns = time.time_ns() if arrived_ns is None else arrived_ns
        try:
            body = protocol.client_body(protocol.parse_body(raw))
            check_before_prefill(
                endpoint, body, self.max_model_len
            )  # what decode alone would refuse, before prefill runs
        except BadRequest as exc:
            err_type = exc.error_type if isinstance(exc, FieldErrors) else "BadRequestError"
            await out.error(400, exc.message, err_type, exc.param)
            self._state.stats.finished(endpoint, Outcome.CLIENT_ERROR)
            return
        is_stream = body.get("stream") is True
        trace = Trace(out.request_id, endpoint, stream=is_stream)
        self._state.record(trace)
        headers = {"X-Request-Id": out.request_id}
        if auth is not None:
            headers["Authorization"] = auth
        deadline = time.monotonic() + self._t.request
        timeline = Timeline(arrived, admitted, itl=self._state.stats.timings.itl)
        body, progress = self._migrator.watch(endpoint, body, is_stream)
        call = Call(endpoint, body, headers, out, trace, is_stream, deadline, self._t.request, timeline,
                    self._prompt(body), progress)  # fmt: skip
        slot = HandoffSlot(self._state.ledger, out.request_id)
        span = None
        if self._tracing is not None:
            span = self._tracing.start(out.request_id, endpoint, is_stream, arrived_ns)
            self._tracing.inject(span, headers)  # so vLLM's spans join this request's trace
            trace.trace_id = f"{span.get_span_context().trace_id:032x}"
        begun = time.perf_counter()
        try:
            if whole_on is None:
                await self._serve(call, slot)
            else:
                # The admin's reference request (wholeon.py): that instance alone, whole.
                await serve_whole_on(self._decoder, call, slot, whole_on)
        except UpstreamError as failed:
            # A stream that broke after the client had tokens may go on elsewhere (migrate.py); the
            # answer of one named instance may not.
            is_movable = out.started and whole_on is None
            told = await self._migrator.resume(call, failed, self._serve) if is_movable else failed
            if told is not None:
                log.warning("request %s failed: %s", out.request_id, told)
                retry_after = getattr(told, "retry_after_s", None)
                extra = [(b"retry-after", str(retry_after).encode())] if retry_after else []
                await out.error(told.status, str(told), told.error_type, extra=extra)
        finally:
            timeline.ended = time.perf_counter()
            outcome = Outcome.of(out)
            is_client_gone = outcome is Outcome.CLIENT_DISCONNECTED
            error = "client disconnected" if is_client_gone else out.failure
            trace.total_ms = (timeline.ended - begun) * 1000
            trace.timeline = timeline
            trace.error, trace.stream_error_event = error, out.has_error_event
            trace.outcome = outcome._value_  # the value without Enum's property call, once a request
            self._state.stats.timed(timeline)
            self._state.stats.finished(endpoint, outcome)
            slot.finish(error or "request ended", is_client_gone)  # open still: decode never answered
            if span is not None and self._tracing is not None:
                attributes = {"pdserve.outcome": outcome.value, "pdserve.prefill_url": trace.prefill_url,
                              "pdserve.decode_url": trace.decode_url, "http.response.status_code": out.status,
                              "pdserve.retries": len(trace.retries)}  # fmt: skip
                self._tracing.finish(span, timeline, arrived_ns, attributes, trace.error)

    def _serve(self, call: Call, slot: HandoffSlot, avoid: Sequence[Instance] = ()) -> Awaitable[None]:
        """The attempts, in order, until the client has its answer; an ``UpstreamError`` says why not.
        In an elastic pool the router places the request first (after the hold) and hears when it ends.
        ``avoid``: decodes a migrated stream's continuation does not go back to. (Not a coroutine itself:
        a fixed pool's request awaits the attempts with one frame fewer.)"""
        local_reason = (
            "colocated: no split" if self._config.colocated else protocol.needs_local_prefill(call.body)
        )
        hold = self._state.hold
        if hold is None:
            return self._attempts(call, slot, local_reason, None, avoid)
        return self._placed(hold, call, slot, local_reason, avoid)

    async def _placed(
        self, hold: Hold, call: Call, slot: HandoffSlot, local_reason: str | None, avoid: Sequence[Instance]
    ) -> None:
        placed, local_reason = await place(hold, self._chooser.members, call, local_reason)
        try:
            await self._attempts(call, slot, local_reason, placed, avoid)
        finally:
            hold.done(placed.placement, placed.measured(call))

    async def _attempts(
        self, call: Call, slot: HandoffSlot, local_reason: str | None, placed: Placed | None,
        avoid: Sequence[Instance] = (),
    ) -> None:  # fmt: skip
        retries = DecodeTries()
        if avoid:  # a migrated stream's continuation: not back to the decode that failed it
            retries.tried.extend(avoid)
            retries.is_first = False
        while True:
            # Decode is picked first: what it caches decides whether prefill is worth a hop. After a
            # stale connection it is the same one again (``_once_more_on_a_fresh_connection``). In an
            # elastic pool the router's pick takes the first attempt, and a retry is served whole by
            # the chooser's pick: the instance that prefilled may be the only one left, and it cannot
            # pull from itself.
            if retries.again is not None:
                decode, retries.again = retries.again, None
            elif placed is not None and retries.is_first:
                decode = placed.placement.decode
            elif placed is not None:
                decode, local_reason = elastic_retry(
                    self._state, self._chooser, call, slot, retries, local_reason
                )
            else:
                try:
                    decode, num_cached = self._chooser.decode(retries.tried, call.prompt)
                except NoInstanceAvailable as exc:
                    decode, num_cached = self._chooser.stand_in(retries.tried, exc), 0
                    slot.abandon("no decode in service: served whole by a prefill", "decode_failed")
                    local_reason = f"no decode instance in service ({exc.detail}): served whole by prefill"
                if retries.is_first and local_reason is None:
                    local_reason = self._skip_reason(call.prompt, num_cached)
            # Prefill, when the request is split and no handoff is in play (the last decode attempt may
            # have left its handoff for this one: ``_before_retry``).
            if local_reason is None and slot.handoff is None:
                if placed is not None:
                    first = placed.placement.prefill if retries.is_first else None
                    prefilled = await self._prefiller.attempts(call, first, avoid=decode)
                    placed.prefilled()
                else:
                    prefilled = await self._prefiller.attempts(call)
                if isinstance(prefilled, Relayed):
                    return
                if isinstance(prefilled, PrefillFailed):
                    # An elastic pool's decode can always compute the prompt itself.
                    if not (self._config.retries.fallback_to_local_prefill or placed is not None):
                        await self._give_up("prefill", prefilled.url, prefilled.failure, call)
                        return
                    local_reason = (
                        f"prefill failed ({describe(prefilled.failure)}); decode computes the prompt"
                    )
                    log.warning("request %s: %s", call.request_id, local_reason)
                else:
                    slot.open(prefilled)
                    call.trace.kv_transfer_params = prefilled.params
            call.trace.local_prefill_reason = local_reason
            # Decode, streaming its answer back. A retry goes to another instance: none left (or no
            # attempts left) makes this the last, whose failure the client hears of.
            has_others = self._chooser.has_other("decode", retries.tried, decode)
            is_last = retries.num_failed + 1 >= self._config.retries.max_decode_attempts or not has_others
            call.trace.decode_url = decode.url
            handoff = slot.handoff
            was_split = handoff is not None and placed is None
            # An error event before any token is relayed only when nothing may follow: the only decode
            # failing its pull (vLLM streams that as its first event) computes the prompt itself next.
            may_redo = may_compute_itself(retries, self._config.retries, was_split)
            decoded = await self._decoder.attempt(call, decode, slot, is_last and not may_redo)
            if isinstance(decoded, Served):
                if handoff is not None and 400 <= (call.trace.decode_status or 0) < 500:
                    self._releaser.release(call, decode, handoff)  # decode refused: free prefill's KV
                return
            retries.is_first = False  # what follows is a retry
            if isinstance(decoded, DecodeFailed) and decoded.is_stale and not retries.num_stale:
                self._once_more_on_a_fresh_connection(call, slot, decode, retries)
            elif isinstance(decoded, DecodeFailed) and is_last:
                # Decode answered (alive) before a prefill is asked to stand in: its pull failing most
                # often means the prefill holding the KV died, which would then fail the stand-in too.
                failed = f"decode {decode.url} failed ({describe(decoded.failure)})"
                if redo := computes_itself(self._state, call, slot, decode, decoded, retries,
                                           self._config.retries, was_split):  # fmt: skip
                    call, local_reason = redo, f"{failed} on a split request: it computes the prompt itself"
                elif not (has_others or placed is not None) and stand_in(
                    self._state, self._chooser, slot, decode, retries, self._config.retries
                ):
                    local_reason = f"{failed}: served whole by prefill"
                    call.trace.retries.append(f"{failed}; a prefill stands in")
                else:
                    await self._give_up("decode", decode.url, decoded.failure, call)
                    return
            else:
                call = await self._before_retry(call, slot, decode, decoded, retries, has_others)

    def _once_more_on_a_fresh_connection(
        self, call: Call, slot: HandoffSlot, decode: Instance, retries: DecodeTries
    ) -> None:
        """A kept-alive connection to ``decode`` closed before it answered anything: most likely decode
        had closed it while idle and never read the request, so the next attempt goes to the same
        decode, once, unseen by the client.

        The same decode, not the chooser's next pick: the connection failed, not the instance (its
        breaker is not told), and what made the chooser pick it (its prefix cache of this prompt, its
        load) still holds, so a round robin or a cache-aware policy is not turned aside by a closed
        socket; HTTP clients and routers that pool connections retry a request lost this way on a new
        connection to the same server. Under a fresh handoff: had decode died on the request after
        pulling the KV, prefill has freed those blocks, and another pull of them would read whatever is
        there."""
        retries.num_stale += 1
        retries.again = decode
        self._state.stats.retried("decode_stale")
        call.trace.retries.append(f"decode {decode.url}: a kept-alive connection was closed; once more")
        slot.abandon(f"decode {decode.url}: stale connection", "decode_failed")

    async def _before_retry(
        self, call: Call, slot: HandoffSlot, decode: Instance, decoded: DecodeFailed | LeaseSuspect,
        retries: DecodeTries, has_others: bool,
    ) -> Call:  # fmt: skip
        """Ready the next decode attempt after ``decode`` did not serve: which decodes it avoids, whether
        the handoff in play may be reused (left in ``slot``) or a fresh prefill is needed, and the
        backoff. Returns the call to make next; raises when the lease guard has withheld too many
        answers."""
        if isinstance(decoded, LeaseSuspect):  # decode already closed the handoff as suspect
            retries.num_lease += 1
            call.trace.retries.append(f"decode {decode.url}: {decoded.why}; prefilling again")
            self._state.stats.retried("lease")
            if retries.num_lease > _MAX_LEASE_RETRIES:
                raise UpstreamUnavailable("decode", decode.url, f"KV lease: {decoded.why} "
                                          f"(and after {_MAX_LEASE_RETRIES} fresh prefills)")  # fmt: skip
            if has_others:
                retries.tried.append(decode)  # it may be the reason (stalled): let another take it
            # The late pull left its wrong blocks in decode's prefix cache under this prompt's hashes.
            salt = f"lease-retry-{uuid.uuid4().hex[:16]}"
            return call._replace(body=protocol.with_fresh_cache_salt(call.body, salt))
        retries.num_failed += 1
        retries.tried.append(decode)
        call.trace.retries.append(f"decode {decode.url}: {describe(decoded.failure)}")
        self._state.stats.retried("decode")
        if slot.handoff is not None and not self._may_reuse(slot.handoff, decoded):
            # decode may have pulled, and prefill freed, those blocks: prefill again
            slot.abandon(f"decode {decode.url}: {describe(decoded.failure)}", "decode_failed")
        await call.sleep(self._config.retries.backoff(retries.num_failed))
        return call

    @staticmethod
    def _may_reuse(handoff: Handoff, decoded: DecodeFailed) -> bool:
        """Prefill's params may go to the next decode only if the failed one never read them and they
        leave the next one time to start its pull before the lease runs out."""
        return decoded.kv_unused and handoff.is_fresh()

    # --- choosing ---------------------------------------------------------------------------------

    def _prompt(self, body: dict[str, Any]) -> Prompt | None:
        """The prompt's tokens and block hashes, when a policy or the skip rule needs them."""
        if self._tokenizer is None:  # nothing to tokenize with: asked nothing more
            return None
        state = self._state
        wants = (
            state.policy("prefill").wants_prompt
            or state.policy("decode").wants_prompt
            or state.elastic is not None
        )
        if self._tokenizer is None or not (wants or self._config.routing.skip_prefill_below_tokens):
            return None
        ids = self._tokenizer.token_ids(body)
        if ids is None:
            return None
        salt = body.get("cache_salt")
        hashes = block_hashes(
            ids, self._config.routing.prefix_block_size, salt if isinstance(salt, str) else None
        )
        return Prompt(len(ids), hashes)

    def _skip_reason(self, prompt: Prompt | None, num_cached: int) -> str | None:
        """Why decode should compute this prompt itself (conditional disaggregation), or None."""
        threshold = self._config.routing.skip_prefill_below_tokens
        if prompt is None or not should_skip_prefill(prompt.num_tokens, num_cached, threshold):
            return None
        return f"{prompt.num_tokens - num_cached} uncached prompt tokens < {threshold}"

    async def _give_up(self, phase: str, url: str, failure: UpstreamError | Reply, call: Call) -> None:
        """The last attempt of ``phase`` failed: the client hears of that failure."""
        if isinstance(failure, UpstreamError):
            raise failure
        await relay_rejection(phase, url, failure, call.out)
