"""A request's path through the proxy: parse it, make its plan, and perform the plan's steps.

    parse → Plan (plan.py) → loop: step = plan.next() → perform it → report its result to the plan
          (a wait for room at decode, backpressure.py; prefill; decode; a backoff, release or give-up)
          → the client has its answer (or an error naming the phase and instance)

The loop knows no rule: which instance, split or whole, retry, give up, all is the plan's. Performing
is prefill.py's (one prefill call), decode.py's (decode serves the client: decode pulls the KV over
NIXL, not via us), release.py's (a refused handoff's KV given back) and the client's ``Responder``. In an
elastic pool the hold (holding.py) keeps the request back while the pool has no room, the router
places it, and hears when it ends. Once the client has bytes, a broken stream goes on from another
instance (migrate.py) through a continuation plan, or ends with an error event.

The KV cache never passes through here: only its address (``kv_transfer_params``) does. vLLM's own
rejections (4xx, 5xx) reach the client with vLLM's status and body. The overall deadline
(``Timeouts.request``) bounds every attempt, backoff and lease retry together (``Call.limit``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Any

from pdserve import protocol
from pdserve.blocks import block_hashes
from pdserve.config import ProxyConfig
from pdserve.errors import BadRequest, UpstreamError
from pdserve.protocol import Endpoint
from pdserve.proxy.kv.guard import LeaseGuard
from pdserve.proxy.pool.choice import Chooser
from pdserve.proxy.pool.holding import Hold
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.routing import Prompt
from pdserve.proxy.pool.state import Outcome, ProxyState
from pdserve.proxy.record.otel import RequestTracing
from pdserve.proxy.record.record import Trace
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.record.timeline import Timeline
from pdserve.proxy.request.decode import Decoder
from pdserve.proxy.request.handover import Handover
from pdserve.proxy.request.migrate import Migrator
from pdserve.proxy.request.plan import DecodeStep, Plan, Rules
from pdserve.proxy.request.prefill import Prefiller
from pdserve.proxy.request.release import Releaser
from pdserve.proxy.request.steps import (
    Backoff,
    Call,
    GiveUp,
    PrefillStep,
    Release,
    WaitForDecode,
    relay_rejection,
)
from pdserve.proxy.request.tokens import PromptTokenizer
from pdserve.proxy.request.validation import FieldErrors, check_before_prefill

log = logging.getLogger("pdserve.proxy")


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
        self._rules = Rules(state, config, self._chooser, LeaseGuard(state, state.ledger))
        self._prefiller = Prefiller(config.timeouts)
        self._decoder = Decoder(config.timeouts)
        self._handover = Handover(
            self._prefiller, self._decoder, config.kv_lease_s, config.first_token_at_once, state.push_stranded
        )
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
        answer (wholeon.py): no hold, no placement and no migration either."""
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
        headers = {"X-Request-Id": out.request_id}
        if auth is not None:
            headers["Authorization"] = auth
        deadline = time.monotonic() + self._t.request
        body, progress = self._migrator.watch(endpoint, body, is_stream)
        call = Call(endpoint, body, headers, out, is_stream, deadline, self._t.request, protocol.PATHS[endpoint],
                    self._prompt(body), progress)  # fmt: skip
        trace = Trace(out.request_id, endpoint, stream=is_stream)
        timeline = Timeline(arrived, admitted, itl=self._state.stats.timings.itl)
        plan = Plan(self._rules, call, trace, timeline, (), whole_on)
        self._state.record(trace)
        span = None
        if self._tracing is not None:
            span = self._tracing.start(out.request_id, endpoint, is_stream, arrived_ns)
            self._tracing.inject(span, headers)  # so vLLM's spans join this request's trace
            plan.traced(f"{span.get_span_context().trace_id:032x}")
        begun = time.perf_counter()
        try:
            hold = self._state.hold
            # an elastic pool's hold and router place the request first (no frame more for a fixed pool's)
            await (self._steps(plan) if hold is None or whole_on is not None else self._placed(hold, plan))
        except UpstreamError as failed:
            # A stream that broke after the client had tokens may go on elsewhere (migrate.py); the
            # answer of one named instance may not.
            is_movable = out.started and whole_on is None
            told = await self._migrator.resume(plan, failed, self._run) if is_movable else failed
            if told is not None:
                log.warning("request %s failed: %s", out.request_id, told)
                retry_after = getattr(told, "retry_after_s", None)
                extra = [(b"retry-after", str(retry_after).encode())] if retry_after else []
                await out.error(told.status, str(told), told.error_type, extra=extra)
        finally:
            outcome = plan.finish(begun)
            stats = self._state.stats
            stats.timed(plan.timeline)
            stats.finished(endpoint, outcome)
            if span is not None and self._tracing is not None:
                attributes = {"pdserve.outcome": outcome.value, "pdserve.prefill_url": trace.prefill_url,
                              "pdserve.decode_url": trace.decode_url, "http.response.status_code": out.status,
                              "pdserve.retries": len(trace.retries)}  # fmt: skip
                self._tracing.finish(span, plan.timeline, arrived_ns, attributes, trace.error)

    def _run(self, plan: Plan) -> Awaitable[None]:
        """The plan's steps until the client has its answer; an ``UpstreamError`` says why not. In an
        elastic pool the hold and the router place the request first, and the router hears when it ends.
        (Not a coroutine itself: a fixed pool's request awaits the steps with one frame fewer.)"""
        hold = self._state.hold
        if hold is None:
            return self._steps(plan)
        return self._placed(hold, plan)

    async def _placed(self, hold: Hold, plan: Plan) -> None:
        num_tokens, max_tokens = plan.size()
        placement, held_s = await hold.place(self._chooser.members, num_tokens, max_tokens)
        plan.placed(placement, num_tokens, held_s)
        try:
            await self._steps(plan)
        finally:
            hold.done(placement, plan.measured())

    async def _steps(self, plan: Plan) -> None:
        """Perform each step the plan names and tell it what came of it; it answers with the next."""
        step = plan.next()
        while step is not None:
            if isinstance(step, DecodeStep):
                step = plan.decoded(await self._decoder.attempt(step))
            elif isinstance(step, PrefillStep):
                step = await self._handover.prefill(plan, step)  # and decode's, when it went early
            elif isinstance(step, WaitForDecode):
                call = plan.call
                step = plan.waited(
                    await self._state.backpressure.wait(step.decode, call.deadline, call.request_s)
                )
            else:
                if isinstance(step, Backoff):
                    await plan.call.sleep(step.seconds)
                elif isinstance(step, Release):
                    self._releaser.release(step)
                else:
                    await _give_up(step, plan.call.out)
                step = plan.next()

    # --- what the request's prompt is -------------------------------------------------------------

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
        if not (wants or self._config.routing.skip_prefill_below_tokens):
            return None
        ids = self._tokenizer.token_ids(body)
        if ids is None:
            return None
        salt = body.get("cache_salt")
        hashes = block_hashes(
            ids, self._config.routing.prefix_block_size, salt if isinstance(salt, str) else None
        )
        return Prompt(len(ids), hashes)


async def _give_up(step: GiveUp, out: Responder) -> None:
    """The last attempt of a phase failed: the client hears of that failure."""
    if isinstance(step.failure, UpstreamError):
        raise step.failure
    await relay_rejection(step.phase, step.url, step.failure, out)
