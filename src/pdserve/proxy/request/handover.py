"""The hand-over between a split request's legs: which sequence a prefill step starts (docs/handover.md).

    pull (serial)  prefill ──answer──▶ decode (pulls the KV)            the plan's own steps, as they are
    push           decode ─┐ sent first, with the prefill instance's identity; it registers blocks
                   prefill ┴ sent at once, same X-Request-Id; it WRITEs the KV as it finishes
    first token    prefill's answer ─▶ the client at once; decode's stream goes on after it

The plan (plan.py) still decides every step and hears every result: ``Handover.prefill`` performs its
``PrefillStep`` and, when the plan answers with the ``DecodeStep`` for the decode an early leg went to,
performs that too, the decode attempt adopting the early leg (``legs.py``) instead of sending anew.

A prefill instance's identity (engine id, side channel, sizes) comes from its own answers: until one is
known, and for pull instances always, the legs are serial. Once decode registered blocks, prefill's leg
is never aborted: vLLM 0.32 frees blocks registered for a push only when the push arrives, so a client
that leaves closes decode's request at once and lets prefill's finish in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final

import orjson

from pdserve import protocol
from pdserve.errors import UpstreamError, UpstreamSuspectAnswer, UpstreamUnavailable
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.request.decode import Decoder
from pdserve.proxy.request.firsttoken import EarlyToken, FirstTokenCut, early_token, may_send_early
from pdserve.proxy.request.legs import Adopted, EarlyLeg
from pdserve.proxy.request.plan import DecodeStep, Plan, Step
from pdserve.proxy.request.prefill import Prefiller
from pdserve.proxy.request.steps import Call, LeaseSuspect, Prefilled, PrefillStep, Relayed, Served, describe
from pdserve.proxy.wire.upstream import Reply

log = logging.getLogger("pdserve.proxy")

# What decode needs of the prefill instance to register blocks with it (push_scheduler.py).
_IDENTITY_KEYS: Final[tuple[str, ...]] = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "pp_size",
)
# Required by vLLM's metadata; in push mode used only for heartbeats, which prefill ignores for an id it
# does not hold, so any placeholder will do until prefill has answered.
_PLACEHOLDER_REQUEST_ID: Final = "pdserve-push-pending"

PrefillResult = Prefilled | Relayed | UpstreamError | Reply


class Handover:
    """One per proxy worker: performs prefill steps in the sequence each instance allows."""

    def __init__(
        self,
        prefiller: Prefiller,
        decoder: Decoder,
        lease_s: float,
        first_token: bool = False,
        stranded: Callable[[Instance], None] = Instance.push_stranded,
    ) -> None:
        self._prefiller = prefiller
        self._stranded = stranded  # a decode may hold blocks for a push that never comes (ProxyState's)
        self._decoder = decoder
        self._lease_s = lease_s
        self._first_token = first_token
        self._identities: dict[str, dict[str, Any]] = {}  # push prefill instance URL → its identity
        self._background: set[asyncio.Task[PrefillResult]] = set()  # prefills left to finish

    def identity(self, prefill_url: str) -> dict[str, Any] | None:
        """The push identity learned for ``prefill_url`` (None: not known, or a pull instance)."""
        return self._identities.get(prefill_url)

    def forget(self, prefill_url: str) -> None:
        """The instance restarted or failed: its next request goes serially and tells it anew."""
        self._identities.pop(prefill_url, None)

    async def prefill(self, plan: Plan, step: PrefillStep) -> Step | None:
        """Perform ``step`` (and, when decode's leg went early, the decode step the plan names next);
        the step after them."""
        call, prefill = step.call, step.instance
        if not (self._identities or self._first_token):  # no push instance known: the serial sequence
            result = await self._prefiller.attempt(step)
            if isinstance(result, Prefilled) and result.params.get("transfer_mode") == "push":
                self._learn(prefill, result)
            return plan.prefilled(result, prefill)
        leg = self._early_leg(plan, step)
        if leg is None:
            result = await self._prefiller.attempt(step)
        else:
            result = await self._beside(leg, step)
        self._learn(prefill, result)
        # a continuation's client has its tokens already: nothing to gain, and its token must be decode's
        early = None if plan.is_continuation else self._send_early(call, result)
        nxt = plan.prefilled(result, prefill)
        if isinstance(result, Prefilled) and (leg is not None or early is not None):
            mode = "push concurrent" if leg is not None else str(result.params.get("transfer_mode", "pull"))
            plan.handed_over(mode if early is None else f"{mode} + first token at once")
        # Decode's early leg waits for this prefill's WRITE: only that prefill's success may adopt it. After
        # a failure the plan may name the same decode to compute the prompt itself, which needs a request
        # of its own (the leg's would wait for a WRITE that never comes).
        if leg is not None and not (
            isinstance(result, Prefilled) and isinstance(nxt, DecodeStep) and nxt.instance is leg.decode
        ):
            self._left(leg, prefill, result)
            leg = None
        if (early is None and leg is None) or not isinstance(nxt, DecodeStep):
            return nxt
        if early is not None:
            await call.out.open_stream("text/event-stream")
            events = early.events
            if early.has_ids and call.progress is not None:  # what a continuation would go on from
                events = call.progress.feed(events)
            await call.out.chunk(events)
            plan.timeline.chunk(time.perf_counter())
        cut = FirstTokenCut(call.endpoint, early.text, early.has_ids) if early is not None else None
        upstream = Adopted(nxt.instance, leg, cut, self._lease_s, nxt)
        if early is None:
            return plan.decoded(await self._decoder.attempt(nxt, upstream))
        try:
            decoded = await self._decoder.attempt(nxt, upstream)
        except UpstreamSuspectAnswer:
            raise
        except UpstreamError as exc:
            if early.has_ids:
                raise  # the stream goes on from prefill's token elsewhere (migrate.py)
            raise _no_continuation(nxt.instance, exc.detail) from None
        if not isinstance(decoded, Served):
            why = decoded.why if isinstance(decoded, LeaseSuspect) else describe(decoded.failure)
            if early.has_ids and not isinstance(decoded, LeaseSuspect):
                raise UpstreamUnavailable("decode", nxt.instance.url, why)
            raise _no_continuation(nxt.instance, why)
        return plan.decoded(decoded)

    # --- the sequences ----------------------------------------------------------------------------------

    def _early_leg(self, plan: Plan, step: PrefillStep) -> EarlyLeg | None:
        """Decode's request, sent now, when the prefill instance takes pushes and is known."""
        decode, identity = plan.decode, self._identities.get(step.instance.url)
        if decode is None or identity is None:
            return None
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": None,
                  "remote_request_id": _PLACEHOLDER_REQUEST_ID, **identity}  # fmt: skip
        payload = orjson.dumps(protocol.decode_body(step.call.body, params))
        return EarlyLeg(step.call, decode, payload)

    async def _beside(self, leg: EarlyLeg, step: PrefillStep) -> PrefillResult:
        """Prefill's call while decode's leg is out. Cancelled (the client left, the deadline passed):
        decode's request is closed, prefill's goes on in the background so that its WRITE frees the
        blocks decode registered."""
        task = asyncio.create_task(self._prefiller.attempt(step))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            leg.close()
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            task.add_done_callback(lambda done: self._strands(leg, done))
            raise

    def _learn(self, prefill: Instance, result: PrefillResult) -> None:
        if isinstance(result, Prefilled):
            params = result.params
            if params.get("transfer_mode") == "push":
                identity = {k: params[k] for k in _IDENTITY_KEYS if k in params}
                if self._identities.get(prefill.url) != identity:
                    self._identities[prefill.url] = identity
            else:
                self._identities.pop(prefill.url, None)
        elif isinstance(result, UpstreamError | Reply):
            self.forget(prefill.url)  # it may come back as another engine

    def _send_early(self, call: Call, result: PrefillResult) -> EarlyToken | None:
        if not (self._first_token and isinstance(result, Prefilled) and result.answer):
            return None
        if call.out.started or not may_send_early(call.body, call.is_stream):
            return None
        return early_token(call.endpoint, result.answer, with_ids=call.progress is not None)

    def _left(self, leg: EarlyLeg, prefill: Instance, result: PrefillResult) -> None:
        """The plan did not send decode's step to the early leg's decode: close it. Had prefill not
        answered, the blocks decode registered for it stay until decode restarts (vLLM 0.32; `pdserve up`'s
        supervisor restarts a push decode that sits idle holding them: engines/stranded.py, and the
        decode rests once it may hold several: instance.py)."""
        leg.close()
        if not isinstance(result, Prefilled):
            log.warning("request %s: decode %s may hold blocks registered for prefill %s until it restarts "
                        "(vLLM frees blocks registered for a push only when the push arrives; a supervised "
                        "decode is restarted once it sits idle holding them)",
                        leg.call.request_id, leg.decode.url, prefill.url)  # fmt: skip
            self._stranded(leg.decode)

    def _strands(self, leg: EarlyLeg, prefill: asyncio.Task[PrefillResult]) -> None:
        """A prefill left to finish in the background (its client left) did not: its push never comes."""
        if (
            prefill.cancelled()
            or prefill.exception() is not None
            or not isinstance(prefill.result(), Prefilled)
        ):
            log.warning("decode %s may hold blocks registered for a push that never came (request %s, left "
                        "by its client)", leg.decode.url, leg.call.request_id)  # fmt: skip
            self._stranded(leg.decode)


def _no_continuation(decode: Instance, why: str) -> UpstreamSuspectAnswer:
    """Decode failed after the client had prefill's first token, and prefill named no ids to go on from
    (a stream no migration may continue): the stream ends with an error event."""
    return UpstreamSuspectAnswer("decode", decode.url, f"after the first token from prefill: {why}")
