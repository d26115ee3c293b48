"""The rules that let the instances left serve a request when its own choice failed.

- ``stand_in``: a fixed pool whose only decode failed before the client's first byte (or none is in
  service): a prefill instance in service serves the request whole, as any vLLM instance can.
- ``computes_itself``: a fixed pool's last decode answered a split request with a 5xx or, streamed, an
  error event before any token (alive, but its pull failed: the prefill holding the KV died or freed
  it): that decode serves the request whole, once, before any prefill is asked to stand in (the prefill
  that held the KV is the likely casualty).
- ``elastic_retry``: an elastic pool's decode retry goes to another instance, with the unread handoff
  when that is not the instance holding the KV, else whole.

``DecodeTries`` is what the decode attempts of one request so far leave to the next one (flow.py).
"""

from __future__ import annotations

import uuid

from pdserve import protocol
from pdserve.configparts import Retries
from pdserve.errors import NoInstanceAvailable
from pdserve.proxy.attempt import Call, DecodeFailed, HandoffSlot
from pdserve.proxy.choice import Chooser
from pdserve.proxy.instance import Instance
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Reply


class DecodeTries:
    """What the decode attempts of one request so far leave to the next one."""

    __slots__ = (
        "again",
        "computed_itself",
        "is_first",
        "num_failed",
        "num_lease",
        "num_stale",
        "stood_in",
        "tried",
    )

    def __init__(self) -> None:
        self.tried: list[Instance] = []  # decodes that failed or were given up on
        self.num_failed = 0  # decode attempts that failed
        self.num_lease = 0  # answers the lease guard withheld
        self.num_stale = 0  # decode attempts lost to a kept-alive connection the instance had closed
        self.again: Instance | None = None  # the decode the next attempt goes to, not the chooser's pick
        self.stood_in = False  # a prefill instance has taken the request whole (no decode could)
        self.computed_itself = False  # the failed decode has been asked again, computing the prompt
        self.is_first = True  # no decode attempt has been made yet (the flow clears it after the first)


def stand_in(
    state: ProxyState,
    chooser: Chooser,
    slot: HandoffSlot,
    decode: Instance,
    retries: DecodeTries,
    config: Retries,
) -> Instance | None:
    """The only decode failed before the client's first byte and cannot compute the prompt itself: a
    prefill instance in service takes the request whole, once (None: none can, or one already did)."""
    if retries.stood_in or not config.prefill_stands_in or not state.pool("prefill").available():
        return None
    retries.stood_in = True
    retries.tried.append(decode)
    retries.again = chooser.stand_in(retries.tried, NoInstanceAvailable("decode", "-"))
    slot.abandon(f"decode {decode.url} failed: a prefill stands in", "decode_failed")
    state.stats.retried("decode")
    return retries.again


def may_compute_itself(retries: DecodeTries, config: Retries, was_split: bool) -> bool:
    """Whether a failure of this decode attempt may still be followed by ``computes_itself``."""
    return was_split and not retries.computed_itself and config.fallback_to_local_prefill


def computes_itself(
    state: ProxyState,
    call: Call,
    slot: HandoffSlot,
    decode: Instance,
    decoded: DecodeFailed,
    retries: DecodeTries,
    config: Retries,
    was_split: bool,
) -> Call | None:
    """The call to send ``decode`` once more, whole, after its answer to a split request (a fixed pool's:
    ``was_split``) was a 5xx or an error event before any token; None: not this time. It answered, so
    it is alive, and a split request's 5xx is most often its KV pull failing (vLLM's ``kv_load_failure_policy=fail``: the prefill
    holding the blocks died mid-pull, or freed them). Under a fresh ``cache_salt``: a failed pull may
    have left blocks in decode's prefix cache under the prompt's hashes."""
    failure = decoded.failure
    if not may_compute_itself(retries, config, was_split):
        return None
    if not isinstance(failure, Reply) or 200 < failure.status < 500:
        return None  # a Reply here is a 5xx, or a 200 stream whose first event was an error
    retries.computed_itself = True
    retries.again = decode
    slot.abandon(f"decode {decode.url} answered {failure.status}: it computes the prompt", "decode_failed")
    state.stats.retried("decode")
    call.trace.retries.append(
        f"decode {decode.url} answered {failure.status}; once more, computing the prompt"
    )
    salt = f"redo-{uuid.uuid4().hex[:16]}"
    return call._replace(body=protocol.with_fresh_cache_salt(call.body, salt))


def elastic_retry(
    state: ProxyState,
    chooser: Chooser,
    call: Call,
    slot: HandoffSlot,
    retries: DecodeTries,
    local_reason: str | None,
) -> tuple[Instance, str | None]:
    """An elastic pool's decode retry: another instance, and the handoff still in play (one the
    failed decode never read) goes there if that is not the instance holding the KV; otherwise the
    retry is served whole (the holder cannot pull from itself; the lease frees its blocks)."""
    handoff = slot.handoff
    holder = state.find(handoff.prefill_url) if handoff is not None else None
    if holder is not None and chooser.has_other("decode", [*retries.tried, holder]):
        decode, _ = chooser.decode([*retries.tried, holder], call.prompt)
        return decode, local_reason
    decode, _ = chooser.decode(retries.tried, call.prompt)
    if handoff is not None:
        slot.abandon("elastic pool: the retry is served whole", "decode_failed")
    return decode, local_reason or "elastic pool: a retry is served whole"
