"""One request's plan: it decides each next step and is the one writer of everything about the request.

    Plan.next() ─▶ WaitForDecode ─▶ backpressure.py ─▶ Plan.waited(turn)
               ─▶ PrefillStep ─▶ prefill.py ─▶ Plan.prefilled(result)
               ─▶ DecodeStep  ─▶ decode.py  ─▶ Plan.decoded(result)
               ─▶ Backoff | Release | GiveUp (the flow performs them) ─▶ None: nothing left to do

In the manner of a scheduler: the flow (flow.py) only asks ``next()``, performs the step and reports
its result; every rule of what follows lives here and in the strategies it consults (survivors.py: who
serves when a request's own choice failed; placing.py: an elastic pool's placement). The plan owns the
request's decode tries, its KV handoff (the only caller of the ledger for it), its placement, and every
write to its ``Trace`` (/requests) and ``Timeline`` (/metrics' phases). Those records are read by no
decision: what the plan decides from, it keeps itself (the decode that answered, its status, why the
prompt was not split).

The order of a split request: decode is chosen first (what it caches decides whether prefill is worth a
hop; an elastic pool's router places both), then prefill on up to the pool's ``max_attempts`` distinct
instances with backoff, then decode with prefill's params. Retries before the client has a byte:
- prefill fails everywhere → decode computes the prompt itself (``fallback_to_local_prefill``) or the
  client hears why; no decode in service → a prefill instance serves the request whole.
- decode fails → another decode, reusing the params only if the failed one never got them and they are
  younger than half the lease (a decode that got them may have pulled, and prefill freed, the blocks);
  the last decode of a split request answering 5xx computes the prompt itself once, then a prefill may
  stand in (survivors.py); a kept-alive connection decode had closed → the same decode once more
  (``_once_more_on_a_fresh_connection`` says why).
- the lease guard withholds an answer (guard.py) → prefill again under a fresh ``cache_salt``, at most
  ``_MAX_LEASE_RETRIES`` times; then decode computes the prompt itself (no handoff to lose).
Once the client has bytes, a broken stream goes on elsewhere (migrate.py) through a continuation plan
that shares this one's record (``continuation``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from pdserve import protocol
from pdserve.config import ProxyConfig
from pdserve.errors import NoInstanceAvailable, UpstreamError, UpstreamUnavailable
from pdserve.proxy.kv.guard import LeaseGuard
from pdserve.proxy.kv.ledger import Handoff
from pdserve.proxy.pool.backpressure import NO_TICKET, Waited
from pdserve.proxy.pool.choice import Chooser
from pdserve.proxy.pool.elastic import Measured, Placement
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.prefix import should_skip_prefill
from pdserve.proxy.pool.state import Outcome, ProxyState
from pdserve.proxy.record.record import Trace
from pdserve.proxy.record.timeline import Timeline
from pdserve.proxy.request.placing import Placed, size
from pdserve.proxy.request.steps import (
    Backoff,
    Call,
    DecodeFailed,
    GiveUp,
    LeaseSuspect,
    Prefilled,
    PrefillStep,
    Relayed,
    Release,
    Served,
    WaitForDecode,
    describe,
)
from pdserve.proxy.request.survivors import Tries, computes_itself, may_compute_itself
from pdserve.proxy.wire.upstream import Reply

log = logging.getLogger("pdserve.proxy")

_MAX_LEASE_RETRIES = 2

# Where a plan stands: choosing the next decode, in a round of prefill attempts, sending decode, done.
_PICK, _PREFILL, _DECODE, _DONE = range(4)


class Rules:
    """What every plan of one proxy consults: its state, config, chooser and lease guard (made once)."""

    __slots__ = ("chooser", "config", "guard", "max_decode_attempts", "max_prefill_attempts", "prefill_ids",
                 "state")  # fmt: skip

    def __init__(self, state: ProxyState, config: ProxyConfig, chooser: Chooser, guard: LeaseGuard) -> None:
        self.state = state
        self.config = config
        self.chooser = chooser
        self.guard = guard
        # the pools' attempt limits, asked of every request
        self.max_prefill_attempts = config.pool("prefill").max_attempts
        self.max_decode_attempts = config.pool("decode").max_attempts
        # a stream that gets prefill's token at once goes on from it if decode's differs: its ids
        self.prefill_ids = config.first_token_at_once


class _PrefillRound:
    """The prefill attempts of one handoff: distinct instances, ``first`` first (the router's pick), never
    ``avoid`` (an elastic pool's decode, which pulls from another instance, not from itself)."""

    __slots__ = ("avoid", "failure", "first", "num", "payload", "tried", "waited")

    def __init__(self, call: Call, first: Instance | None, avoid: Instance | None, keep_ids: bool) -> None:
        # ids only for a stream a migration may continue (its Progress watches it)
        keep_ids = keep_ids and call.progress is not None
        self.payload = orjson.dumps(protocol.prefill_body(call.body, keep_token_ids=keep_ids))
        self.first = first
        self.avoid = avoid
        self.tried: list[Instance] = [] if avoid is None else [avoid]
        self.num = 0  # attempts sent
        self.waited = False  # the backoff before the next attempt is over
        self.failure: UpstreamError | Reply | None = None

    def last_url(self) -> str:
        sent = [i for i in self.tried if i is not self.avoid]
        return sent[-1].url if sent else "-"


class Plan:
    """One request (or a migrated stream's continuation) from its first step to its last."""

    __slots__ = ("_decode", "_delivered", "_handoff", "_local_reason", "_pending", "_phase", "_placed",
                 "_round", "_rules", "_sent", "_ticket", "_tries", "_was_split", "_whole_on", "call",
                 "is_continuation", "timeline", "trace")  # fmt: skip

    # Written before anything reads them: with each prefill round (``_round``: its attempts), with each
    # decode attempt (``_sent``: the handoff whose params went with it; ``_was_split``: a fixed pool's
    # split request).
    _round: _PrefillRound | None
    _sent: Handoff | None
    _was_split: bool

    def __init__(
        self,
        rules: Rules,
        call: Call,
        trace: Trace,
        timeline: Timeline,
        avoid: Sequence[Instance] = (),
        whole_on: Instance | None = None,
    ) -> None:
        """``avoid``: decodes a migrated stream's continuation does not go back to; ``whole_on``: the
        admin's reference request (wholeon.py), that instance's own answer or its error, nothing else."""
        self._rules = rules
        self.call = call
        self.trace = trace
        self.timeline = timeline
        self._tries = Tries(avoid)
        self._local_reason = (
            "colocated: no split" if not rules.config.can_split else protocol.needs_local_prefill(call.body)
        )
        self._phase = _PICK
        self._decode: Instance | None = None  # the decode of the last attempt
        self._handoff: Handoff | None = None  # open: its params go with the next decode attempt
        self._delivered: Handoff | None = None  # the one decode's answer rests on, once it began
        self._placed: Placed | None = None  # an elastic pool's placement
        self._pending: Step | None = None  # a step decided with the last result, to take next
        self._ticket = NO_TICKET  # its place ahead of others at its decode (backpressure.py)
        self.is_continuation = False  # a migrated stream's (``continuation``)
        self._whole_on = whole_on
        if whole_on is not None:
            self._tries.again = whole_on
            self._local_reason = f"asked whole on {whole_on.url} (X-Pdserve-Whole-On)"

    # --- what the flow asks ------------------------------------------------------------------------

    def next(self) -> Step | None:
        """The first step, or the next one after a step that reports nothing (a backoff, a release, a
        relayed rejection); None when the request needs nothing more."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending
        if self._phase == _PICK:
            self._pick()
        if self._phase == _PREFILL:
            step = self._next_prefill()
            if step is not None:
                return step
        return self._decode_step() if self._phase == _DECODE else None

    def prefilled(
        self, result: Prefilled | Relayed | UpstreamError | Reply, prefill: Instance
    ) -> Step | None:
        """What one prefill call came to; the next step."""
        trace = self.trace
        if not isinstance(result, UpstreamError):  # prefill answered: its params, a rejection, or a 5xx
            self.timeline.prefill_done = done = time.perf_counter()
            trace.prefill_ms = (done - (self.timeline.prefill_sent or done)) * 1000
            trace.prefill_status = 200 if isinstance(result, Prefilled) else result.status
        if isinstance(result, Prefilled):
            self._end_round()
            self._ticket.kv_arrived(self.call.is_stream)
            # Prefill's params are in: the KV is pinned under a lease from now on.
            assert self._handoff is None, "a handoff is already in play"
            self._handoff = self._rules.state.ledger.open(
                self.call.out.request_id, result.url, result.params, result.num_kv_expired
            )
            trace.kv_transfer_params = params = result.params
            trace.handover = params.get("transfer_mode") or "pull"  # the serial sequence, unless told
            return self._decode_step()
        if isinstance(result, Relayed):
            self._end_round()
            self._phase = _DONE
            return None
        rnd = self._round
        assert rnd is not None
        rnd.failure = result
        trace.retries.append(f"prefill {prefill.url}: {describe(result)}")
        if time.monotonic() >= self.call.deadline:
            rnd.num = self._rules.max_prefill_attempts  # no time for another
        return self.next()

    def handed_over(self, sequence: str) -> None:
        """How prefill's KV (and first token) reached decode: pull, push, push concurrent, + first token."""
        self.trace.handover = sequence

    def waited(self, turn: Waited) -> Step | None:
        """The request's decode has room for its KV after a wait at the proxy; the next step."""
        self._ticket = turn.ticket
        self.trace.decode_wait = {"ms": round(turn.seconds * 1000, 3), "why": turn.why}
        return self.next()

    def decoded(self, result: Served | DecodeFailed | LeaseSuspect) -> Step | None:
        """What the decode attempt came to; the next step. Raises when the lease guard withheld too many
        answers."""
        decode, tries = self._decode, self._tries
        assert decode is not None
        if isinstance(result, Served):
            self._phase = _DONE
            handoff = self._sent
            if handoff is not None and 400 <= result.status < 500:  # decode refused: free prefill's KV
                return Release(self.call, decode, handoff)
            return None
        tries.is_first = False  # what follows is a retry
        if self._whole_on is not None:  # that instance's answer or its error: nothing else
            failure = result.failure if isinstance(result, DecodeFailed) else UpstreamUnavailable(
                "decode", decode.url, result.why)  # fmt: skip
            return GiveUp("decode", decode.url, failure)
        self._phase = _PICK
        if isinstance(result, DecodeFailed) and result.is_stale and not tries.num_stale:
            self._once_more_on_a_fresh_connection(decode)
        elif isinstance(result, DecodeFailed) and tries.is_last:
            self._after_the_last(decode, result)
        elif isinstance(result, LeaseSuspect):
            self._after_lease_suspect(decode, result)
        else:
            self._after_failure(decode, result)
        return self.next()

    # --- an elastic pool: the hold and the router ------------------------------------------------------

    def size(self) -> tuple[int, int | None]:
        """The prompt's tokens and the answer's budget, as the elastic router counts them."""
        return size(self.call)

    def placed(self, placement: Placement[Instance], num_tokens: int, held_s: float) -> None:
        """The router placed the request (after ``held_s`` in the hold)."""
        router = self._rules.state.elastic
        assert router is not None
        placed = self._placed = Placed(router, placement, num_tokens, held_s)
        self.trace.placement, self._local_reason = placed.accept(self._local_reason)

    def measured(self) -> Measured | None:
        """What the request measured for the router's calibration (``Placed.measured``)."""
        placed = self._placed
        if placed is None:
            return None
        return placed.measured(self.call, self.timeline, is_split=self._local_reason is None)

    # --- the record ------------------------------------------------------------------------------------

    @property
    def decode(self) -> Instance | None:
        """The decode chosen for the next attempt (before a prefill round: the one it hands over to)."""
        return self._decode

    @property
    def decode_url(self) -> str | None:
        """The decode of the last attempt (a continuation's: where a migrated stream went)."""
        return self._decode.url if self._decode is not None else None

    def traced(self, trace_id: str) -> None:
        self.trace.trace_id = trace_id

    def migrated(self, result: str, record: dict[str, Any]) -> None:
        """A broken stream's migration came to ``result`` (migrate.py)."""
        self._rules.state.stats.migrated(result)
        self.trace.migrated({"result": result, **record})

    def continuation(self, call: Call, avoid: Sequence[Instance]) -> Plan:
        """The plan of a migrated stream's continuation: its own handoff and attempts, this record."""
        plan = Plan(self._rules, call, self.trace, Timeline(time.perf_counter()), avoid)
        plan.is_continuation = True
        return plan

    def finish(self, began: float) -> Outcome:
        """The request is over: the record's last fields, a handoff still open abandoned (it never
        reached a decode that answered); the outcome /metrics counts."""
        timeline, trace, out = self.timeline, self.trace, self.call.out
        timeline.ended = time.perf_counter()
        outcome = Outcome.of(out)
        is_client_gone = outcome is Outcome.CLIENT_DISCONNECTED
        error = "client disconnected" if is_client_gone else out.failure
        trace.total_ms = (timeline.ended - began) * 1000
        trace.timeline = timeline
        trace.error, trace.stream_error_event = error, out.has_error_event
        trace.outcome = outcome._value_  # the value without Enum's property call, once a request
        if self._handoff is not None:
            self._abandon(error or "request ended", "client_gone" if is_client_gone else "failed")
        ticket = self._ticket
        if ticket is not NO_TICKET:
            ticket.ended(timeline)  # a stream's gaps between tokens: how often its decode steps
        return outcome

    def continuation_ended(self) -> None:
        self._abandon("continuation ended", "failed")
        self._ticket.release()

    # --- choosing ------------------------------------------------------------------------------------------

    def _pick(self) -> None:
        """The decode of the next attempt, and whether a prefill round comes first."""
        rules, tries, call = self._rules, self._tries, self.call
        chooser, placed = rules.chooser, self._placed
        if tries.again is not None:  # after a stale connection, a stand-in or a redo: that one
            decode, tries.again = tries.again, None
        elif placed is not None and tries.is_first:
            decode = placed.placement.decode
        elif placed is not None:
            # A retry in an elastic pool: the instance that prefilled may be the only one left, and it
            # cannot pull from itself.
            holder = self._handoff.prefill_url if self._handoff is not None else None
            decode, keeps_handoff = chooser.elsewhere(tries.tried, holder, call.prompt)
            if not keeps_handoff:
                self._abandon("elastic pool: the retry is served whole", "decode_failed")
                self._local_reason = self._local_reason or "elastic pool: a retry is served whole"
        else:
            try:
                decode, num_cached = chooser.decode(tries.tried, call.prompt)
            except NoInstanceAvailable as exc:
                decode, num_cached = chooser.stand_in(tries.tried, exc), 0
                self._abandon("no decode in service: served whole by a prefill", "decode_failed")
                self._local_reason = f"no decode instance in service ({exc.detail}): served whole by prefill"
            if (
                tries.is_first
                and self._local_reason is None
                and rules.config.routing.skip_prefill_below_tokens
            ):
                self._local_reason = self._skip_reason(num_cached)
        self._decode = decode
        if self._local_reason is None and self._handoff is None:
            first = placed.placement.prefill if placed is not None and tries.is_first else None
            self._round = _PrefillRound(
                call, first, decode if placed is not None else None, rules.prefill_ids
            )
            if self._ticket.is_held:
                self._ticket.release()  # the round waits for room at its own decode
            self._phase = _PREFILL
        else:
            self._phase = _DECODE

    def _skip_reason(self, num_cached: int) -> str | None:
        """Why decode should compute this prompt itself (conditional disaggregation), or None."""
        threshold = self._rules.config.routing.skip_prefill_below_tokens
        prompt = self.call.prompt
        if prompt is None or not should_skip_prefill(prompt.num_tokens, num_cached, threshold):
            return None
        return f"{prompt.num_tokens - num_cached} uncached prompt tokens < {threshold}"

    # --- prefill ---------------------------------------------------------------------------------------

    def _next_prefill(self) -> WaitForDecode | PrefillStep | Backoff | GiveUp | None:
        """The round's next prefill call (or its backoff); None once the round failed."""
        rnd, rules, call = self._round, self._rules, self.call
        assert rnd is not None
        if rnd.num >= rules.max_prefill_attempts:
            return self._prefill_failed()
        if rnd.num and not rnd.waited:
            if not rules.chooser.has_other("prefill", rnd.tried):
                return self._prefill_failed()  # a retry goes to another instance, and there is none
            rules.state.stats.retried("prefill")
            rnd.waited = True
            return Backoff(rules.config.retries.backoff(rnd.num))
        rnd.waited = False
        if not (rnd.num or self._ticket.is_held) and self._decode is not None:
            ticket = rules.state.backpressure.admit(self._decode)
            if ticket is None:  # no KV before its decode can pull it within the lease
                return WaitForDecode(call, self._decode)
            self._ticket = ticket
        try:
            prefill = rnd.first if not rnd.num and rnd.first is not None else rules.chooser.prefill(
                rnd.tried, call.prompt)  # fmt: skip
        except NoInstanceAvailable as exc:
            rnd.failure = exc  # none in service (e.g. the only one restarting): a fallback may still serve
            return self._prefill_failed()
        rnd.tried.append(prefill)
        rnd.num += 1
        self.trace.prefill_url = prefill.url
        self.timeline.prefill_sent = time.perf_counter()
        return PrefillStep(call, prefill, rnd.payload)

    def _end_round(self) -> None:
        self._round = None
        if self._placed is not None:
            self._placed.prefilled()  # the router counts the placed prefill once, whatever the retries

    def _prefill_failed(self) -> GiveUp | None:
        """Every prefill attempt of the round failed: decode computes the prompt, or the client hears."""
        rnd = self._round
        assert rnd is not None and rnd.failure is not None
        self._end_round()
        # An elastic pool's decode can always compute the prompt itself.
        if not (self._rules.config.retries.fallback_to_local_prefill or self._placed is not None):
            self._phase = _DONE
            return GiveUp("prefill", rnd.last_url(), rnd.failure)
        self._local_reason = f"prefill failed ({describe(rnd.failure)}); decode computes the prompt"
        log.warning("request %s: %s", self.call.request_id, self._local_reason)
        self._phase = _DECODE
        return None

    # --- decode ----------------------------------------------------------------------------------------

    def _decode_step(self) -> DecodeStep:
        rules, tries, decode = self._rules, self._tries, self._decode
        assert decode is not None
        trace = self.trace
        trace.local_prefill_reason = self._local_reason
        # A retry goes to another instance: none left (or no attempts left) makes this the last, whose
        # failure the client hears of.
        tries.has_others = has_others = rules.chooser.has_other("decode", tries.tried, decode)
        tries.is_last = (
            tries.num_failed + 1 >= rules.max_decode_attempts or not has_others or self._whole_on is not None
        )
        trace.decode_url = decode.url
        self._sent = handoff = self._handoff
        self._was_split = handoff is not None and self._placed is None
        # An error event before any token is relayed only when nothing may follow: the only decode
        # failing its pull (vLLM streams that as its first event) computes the prompt itself next.
        may_redo = self._was_split and may_compute_itself(tries, rules.config.retries, True)
        self._phase = _DONE  # until decoded() says otherwise
        self.timeline.decode_sent = time.perf_counter()
        return DecodeStep(self, decode, tries.is_last and not may_redo)

    def _after_the_last(self, decode: Instance, decoded: DecodeFailed) -> None:
        """The last decode failed before the client's first byte: the survivors' rules, or give up."""
        rules, tries = self._rules, self._tries
        failed = f"decode {decode.url} failed ({describe(decoded.failure)})"
        redo = computes_itself(tries, rules.config.retries, self._was_split, decoded)
        if redo is not None:
            tries.computed_itself = True
            self._abandon(f"decode {decode.url} answered {redo}: it computes the prompt", "decode_failed")
            rules.state.stats.retried("decode")
            self.trace.retries.append(f"decode {decode.url} answered {redo}; once more, computing the prompt")
            tries.again = decode
            self._salted("redo")
            self._local_reason = f"{failed} on a split request: it computes the prompt itself"
        elif not (tries.has_others or self._placed is not None or tries.stood_in) and (
            stood_in := rules.chooser.stand_in_for(decode, tries.tried)
        ):
            tries.stood_in = True
            tries.tried.append(decode)
            tries.again = stood_in
            self._abandon(f"decode {decode.url} failed: a prefill stands in", "decode_failed")
            rules.state.stats.retried("decode")
            self._local_reason = f"{failed}: served whole by prefill"
            self.trace.retries.append(f"{failed}; a prefill stands in")
        else:
            self._phase = _DONE
            self._pending = GiveUp("decode", decode.url, decoded.failure)

    def _once_more_on_a_fresh_connection(self, decode: Instance) -> None:
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
        self._tries.num_stale += 1
        self._tries.again = decode
        self._rules.state.stats.retried("decode_stale")
        self.trace.retries.append(f"decode {decode.url}: a kept-alive connection was closed; once more")
        self._abandon(f"decode {decode.url}: stale connection", "decode_failed")

    def _after_lease_suspect(self, decode: Instance, decoded: LeaseSuspect) -> None:
        """The lease guard withheld decode's answer (its handoff is closed as suspect): prefill again,
        under a fresh salt, since the late pull left its wrong blocks in decode's prefix cache under
        this prompt's hashes. After ``_MAX_LEASE_RETRIES`` fresh prefills whose leases all ran out (the
        decode side cannot pull in time: a saturated or stalled host), decode computes the prompt
        itself: the request needs no handoff at all, and an instance that can serve it still does
        (docs/kv-integrity.md says why this cannot serve released KV)."""
        tries = self._tries
        tries.num_lease += 1
        self._rules.state.stats.retried("lease")
        if tries.has_others:
            tries.tried.append(decode)  # it may be the reason (stalled): let another take it
        if tries.num_lease <= _MAX_LEASE_RETRIES:
            self.trace.retries.append(f"decode {decode.url}: {decoded.why}; prefilling again")
            self._salted("lease-retry")
            return
        if tries.computed_itself or not self._rules.config.retries.fallback_to_local_prefill:
            self.trace.retries.append(f"decode {decode.url}: {decoded.why}")
            raise UpstreamUnavailable("decode", decode.url, f"KV lease: {decoded.why} "
                                      f"(and after {_MAX_LEASE_RETRIES} fresh prefills)")  # fmt: skip
        tries.computed_itself = True
        self._local_reason = f"KV lease lost after {_MAX_LEASE_RETRIES} fresh prefills ({decoded.why}): decode computes the prompt"
        self.trace.retries.append(f"decode {decode.url}: {decoded.why}; decode computes the prompt itself")
        log.warning("request %s: %s", self.call.out.request_id, self._local_reason)
        self._salted("lease-local")

    def _after_failure(self, decode: Instance, decoded: DecodeFailed) -> None:
        """Another decode attempt follows, after a backoff: the handoff in play goes with it only if the
        failed decode never read its params and they leave the next one time to pull."""
        tries = self._tries
        tries.num_failed += 1
        tries.tried.append(decode)
        self.trace.retries.append(f"decode {decode.url}: {describe(decoded.failure)}")
        self._rules.state.stats.retried("decode")
        handoff = self._handoff
        if handoff is not None and not (decoded.kv_unused and handoff.is_fresh()):
            self._abandon(f"decode {decode.url}: {describe(decoded.failure)}", "decode_failed")
        self._pending = Backoff(self._rules.config.retries.backoff(tries.num_failed))

    def _salted(self, why: str) -> None:
        salt = f"{why}-{uuid.uuid4().hex[:16]}"
        self.call = self.call._replace(body=protocol.with_fresh_cache_salt(self.call.body, salt))

    # --- the handoff: the ledger hears of it from here only ----------------------------------------------

    def _abandon(self, reason: str, kind: str) -> None:
        """No decode will read the open handoff's params; ``kind`` is the label the ledger counts."""
        if self._handoff is not None:
            self._rules.state.ledger.abandon(self._handoff, reason, kind)
            self._handoff = None

    def _suspect(self, kind: str, why: str) -> None:
        """The KV under the handoff in play (open, or delivered to a stream still going) may have been
        released before decode read it: the ledger marks it, and an open one is dropped with it."""
        handoff = self._handoff or self._delivered
        if handoff is not None:
            self._rules.state.ledger.mark_suspect(handoff, kind, why)
            self._handoff = None


class DecodeStep:
    """Decode serves the client, with the handoff's params (None: it computes the prompt itself).

    The decode attempt (decode.py) tells the plan, through this step, what only it sees as the answer
    comes: its status and first byte, the moment the client's answer is about to begin (the lease
    guard's verdict first), the moment it begins (when the ledger must know the handoff delivered or
    refused) and the stream's end. ``chunk`` is the timeline's own (a chunk costs one clock read and an
    addition)."""

    __slots__ = ("_plan", "call", "chunk", "instance", "is_last", "params")

    def __init__(self, plan: Plan, decode: Instance, is_last: bool) -> None:
        self._plan = plan
        self.call = plan.call
        self.instance = decode
        self.is_last = is_last
        handoff = plan._handoff
        self.params = handoff.params if handoff is not None else None
        self.chunk: Callable[[float], None] = plan.timeline.chunk

    def answered(self, status: int, now: float | None) -> None:
        """Decode's status (``now``: its whole answer came, or its stream's first byte)."""
        plan = self._plan
        plan.trace.decode_status = status
        if now is not None:
            plan.timeline.decode_first_byte = now
        else:
            plan._ticket.reached()  # a stream's status line: decode's API server has the request

    async def trusted(self, now: float | None = None) -> LeaseSuspect | None:
        """The lease guard's verdict on decode's answer, which is about to begin (``now``: a stream's
        first byte came); a suspect one's handoff is closed as such (guard.py empties decode's prefix
        cache of what the pull left)."""
        plan = self._plan
        if now is not None:
            plan.timeline.decode_first_byte = now
        handoff = plan._handoff
        if handoff is None:
            return None
        guard = plan._rules.guard
        suspicion = await guard.check(handoff)
        if suspicion is None:
            return None
        log.warning("request %s: not relaying decode's answer: %s", self.call.request_id, suspicion.why)
        plan._ticket.began()
        plan._suspect(suspicion.kind, suspicion.why)
        await guard.purge(self.instance)
        return LeaseSuspect(suspicion.why)

    def begins(self, status: int) -> None:
        """Decode answered: its first bytes mean it has the KV; a 4xx means vLLM refused the request (a
        refusal in its handler also tells prefill to free the KV; one in its request validation leaves
        it to the lease, or to ``Release``)."""
        plan = self._plan
        if plan._ticket.is_held:
            plan._ticket.began()
        handoff = plan._handoff
        if handoff is None:
            return
        if status == 200:
            plan._rules.state.ledger.delivered(handoff, self.instance.url)
            plan._delivered, plan._handoff = handoff, None
        else:
            plan._abandon(f"decode {self.instance.url} answered {status}", "decode_rejected")

    async def before_the_end(self) -> str | None:
        """Prefill's log may have spoken since the stream began: why the stream is discredited (its
        handoff marked; decode's prefix cache emptied), or None."""
        plan = self._plan
        delivered = plan._delivered
        if delivered is None:
            return None
        guard = plan._rules.guard
        why = guard.from_log(delivered)
        if why is not None:
            plan._suspect("log_during_stream", why)
            await guard.purge(self.instance)
        return why


Step = WaitForDecode | PrefillStep | DecodeStep | Backoff | Release | GiveUp
