"""An elastic pool's request as the flow carries it: held while the pool has no room (holding.py), the
router's placement, recorded on the trace, and the router told once when the placed prefill is over (the
flow tells it when the request ends)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.proxy.attempt import Call
from pdserve.proxy.elastic import ElasticRouter, Measured, Placement
from pdserve.proxy.holding import Hold
from pdserve.proxy.instance import Instance
from pdserve.proxy.tokens import estimate_prompt_tokens


@dataclass
class Placed:
    """The router's placement of one request, and its prompt's size as the router counted it."""

    router: ElasticRouter
    placement: Placement[Instance]
    num_tokens: int
    held_s: float = 0.0  # how long the hold kept it back before placing it
    is_prefilled: bool = False

    def prefilled(self) -> None:
        """The placed prefill is over (the router counts it once, whatever the retries)."""
        if not self.is_prefilled:
            self.is_prefilled = True
            self.router.prefilled(self.placement, self.num_tokens)

    def measured(self, call: Call) -> Measured | None:
        """What ``call`` measured, for the router's calibration: a stream of a few tokens at least that
        ended well, served as placed (split, or whole); None otherwise."""
        t = call.timeline
        if not call.is_stream or call.out.failure is not None or t.first_byte is None or t.num_gaps < 4:
            return None
        if (call.trace.local_prefill_reason is None) != self.placement.is_split:
            return None  # served whole though placed split: a failed prefill, a retry, the flow's reason
        # From its placement: the hold's wait is not the placement's to answer for.
        return Measured(t.first_byte - t.arrived - self.held_s, t.gaps_sum / t.num_gaps)


async def place(
    hold: Hold, members: Callable[[], Sequence[Instance]], call: Call, local_reason: str | None
) -> tuple[Placed, str | None]:
    """Where ``call`` goes among the instances in service (``members``, read after any wait in the hold),
    and why decode computes its prompt when it is not split (``local_reason``: the flow's own reason,
    e.g. n > 1, or the router's choice to serve it whole)."""
    num_tokens = call.prompt.num_tokens if call.prompt is not None else estimate_prompt_tokens(call.body)
    max_tokens = call.body.get("max_tokens", call.body.get("max_completion_tokens"))
    max_tokens = max_tokens if isinstance(max_tokens, int) else None
    placement, held_s = await hold.place(members, num_tokens, max_tokens)
    placed = Placed(hold.router, placement, num_tokens, held_s)
    reason = placement.reason
    if placement.prefill is not None and local_reason is not None:
        placed.prefilled()  # placed as a split, but served whole: local_reason says why
        reason = f"{reason}; served whole: {local_reason}"
    call.trace.placement = {
        "layout": placement.layout,
        "split": placement.prefill is not None and local_reason is None,
        "prefill_url": placement.prefill.url if placement.prefill is not None else None,
        "decode_url": placement.decode.url,
        "reason": reason,
        "held_ms": round(held_s * 1000, 1),
    }
    if local_reason is None and placement.prefill is None:
        local_reason = f"elastic pool: {placement.reason}"
    return placed, local_reason
