"""The rules that let the instances left serve a request when its own choice failed, as the plan
(plan.py) consults them. Each reads the request's tries and the pool and answers; the plan acts on the
answer and writes what follows.

- ``stand_in``: a fixed pool whose only decode failed before the client's first byte (or none is in
  service): a prefill instance in service serves the request whole, as any vLLM instance can.
- ``computes_itself``: a fixed pool's last decode answered a split request with a 5xx or, streamed, an
  error event before any token (alive, but its pull failed: the prefill holding the KV died or freed
  it): that decode serves the request whole, once, before any prefill is asked to stand in (the prefill
  that held the KV is the likely casualty).
- ``elastic_retry``: an elastic pool's decode retry goes to another instance, with the unread handoff
  when that is not the instance holding the KV, else whole.

``Tries`` is what the decode attempts of one request so far leave to the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.configparts import Retries
from pdserve.errors import NoInstanceAvailable
from pdserve.proxy.kv.ledger import Handoff
from pdserve.proxy.pool.choice import Chooser
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.request.steps import Call, DecodeFailed
from pdserve.proxy.wire.upstream import Reply


class Tries:
    """What the decode attempts of one request so far leave to the next one (the plan writes it)."""

    __slots__ = ("again", "computed_itself", "has_others", "is_first", "is_last", "num_failed", "num_lease",
                 "num_stale", "stood_in", "tried")  # fmt: skip

    # Written with each decode attempt, before anything reads them: whether its decode was not the only
    # one in service, and whether it was the last attempt allowed.
    has_others: bool
    is_last: bool

    def __init__(self, avoid: Sequence[Instance] = ()) -> None:
        self.tried: list[Instance] = list(avoid)  # decodes that failed or were given up on
        self.num_failed = 0  # decode attempts that failed
        self.num_lease = 0  # answers the lease guard withheld
        self.num_stale = 0  # decode attempts lost to a kept-alive connection the instance had closed
        self.again: Instance | None = None  # the decode the next attempt goes to, not the chooser's pick
        self.stood_in = False  # a prefill instance has taken the request whole (no decode could)
        self.computed_itself = False  # the failed decode has been asked again, computing the prompt
        # no decode attempt has been made yet (a migrated stream's continuation: one has, elsewhere)
        self.is_first = not avoid


def stand_in(
    state: ProxyState, chooser: Chooser, decode: Instance, tries: Tries, config: Retries
) -> Instance | None:
    """The prefill instance that takes the request whole after its only decode (``decode``) failed
    before the client's first byte and could not compute the prompt itself; None: none can, or one
    already did."""
    if tries.stood_in or not config.prefill_stands_in or not state.pool("prefill").available():
        return None
    return chooser.stand_in([*tries.tried, decode], NoInstanceAvailable("decode", "-"))


def may_compute_itself(tries: Tries, config: Retries, was_split: bool) -> bool:
    """Whether a failure of this decode attempt may still be followed by ``computes_itself``."""
    return was_split and not tries.computed_itself and config.fallback_to_local_prefill


def computes_itself(tries: Tries, config: Retries, was_split: bool, decoded: DecodeFailed) -> int | None:
    """Whether the decode that answered a split request (a fixed pool's: ``was_split``) with a 5xx or an
    error event before any token gets it once more, whole: the status it answered, or None. It answered,
    so it is alive, and a split request's 5xx is most often its KV pull failing (vLLM's
    ``kv_load_failure_policy=fail``: the prefill holding the blocks died mid-pull, or freed them). The
    plan sends it under a fresh ``cache_salt``: a failed pull may have left blocks in decode's prefix
    cache under the prompt's hashes."""
    failure = decoded.failure
    if not may_compute_itself(tries, config, was_split):
        return None
    if not isinstance(failure, Reply) or 200 < failure.status < 500:
        return None  # a Reply here is a 5xx, or a 200 stream whose first event was an error
    return failure.status


def elastic_retry(
    state: ProxyState, chooser: Chooser, call: Call, handoff: Handoff | None, tries: Tries
) -> tuple[Instance, bool]:
    """An elastic pool's decode retry: another instance, and whether the handoff still in play (one the
    failed decode never read) goes there, which it does when that is not the instance holding the KV;
    otherwise the retry is served whole (the holder cannot pull from itself; the lease frees its
    blocks)."""
    holder = state.find(handoff.prefill_url) if handoff is not None else None
    if holder is not None and chooser.has_other("decode", [*tries.tried, holder]):
        decode, _ = chooser.decode([*tries.tried, holder], call.prompt)
        return decode, True
    decode, _ = chooser.decode(tries.tried, call.prompt)
    return decode, False
