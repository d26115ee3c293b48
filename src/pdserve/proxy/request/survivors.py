"""What a request's decode attempts leave to the next one (``Tries``), and the rule that lets the
decode that failed a split request serve it after all, as the plan (plan.py) consults it.

- ``computes_itself``: a fixed pool's last decode answered a split request with a 5xx or, streamed, an
  error event before any token (alive, but its pull failed: the prefill holding the KV died or freed
  it): that decode serves the request whole, once, before any prefill is asked to stand in (the prefill
  that held the KV is the likely casualty).

The other survivors' rules choose an instance, so they are the chooser's (pool/choice.py): a prefill
stands in for a fixed pool's only decode (``Chooser.stand_in_for``), and an elastic pool's retry goes
to another instance, with the unread handoff when that is not the one holding the KV, else whole
(``Chooser.elsewhere``). The plan reads each answer and writes what follows.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.configparts import Retries
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.request.steps import DecodeFailed
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
