"""An elastic pool's request as the plan carries it: the router's placement (after the hold,
holding.py), how it reads in the record, the router told once when the placed prefill is over, and what
a request that ended well measured for the router's calibration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.proxy.pool.elastic import ElasticRouter, Measured, Placement
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.record.timeline import Timeline
from pdserve.proxy.request.steps import Call
from pdserve.proxy.request.tokens import estimate_prompt_tokens


def size(call: Call) -> tuple[int, int | None]:
    """The prompt's tokens (counted, or estimated from its text) and the answer's budget."""
    num_tokens = call.prompt.num_tokens if call.prompt is not None else estimate_prompt_tokens(call.body)
    max_tokens = call.body.get("max_tokens", call.body.get("max_completion_tokens"))
    return num_tokens, max_tokens if isinstance(max_tokens, int) else None


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

    def accept(self, local_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The placement as /requests shows it, and why decode computes the prompt when it is not split
        (``local_reason``: the request's own reason, e.g. n > 1, or the router's choice to serve it
        whole). Placed as a split but served whole, its prefill is over at once."""
        placement = self.placement
        reason = placement.reason
        if placement.prefill is not None and local_reason is not None:
            self.prefilled()
            reason = f"{reason}; served whole: {local_reason}"
        shown = {
            "layout": placement.layout,
            "split": placement.prefill is not None and local_reason is None,
            "prefill_url": placement.prefill.url if placement.prefill is not None else None,
            "decode_url": placement.decode.url,
            "reason": reason,
            "held_ms": round(self.held_s * 1000, 1),
        }
        if local_reason is None and placement.prefill is None:
            local_reason = f"elastic pool: {placement.reason}"
        return shown, local_reason

    def measured(self, call: Call, t: Timeline, is_split: bool) -> Measured | None:
        """What the request measured, for the router's calibration: a stream of a few tokens at least
        that ended well, served as placed (split, or whole); None otherwise."""
        if not call.is_stream or call.out.failure is not None or t.first_byte is None or t.num_gaps < 4:
            return None
        if is_split != self.placement.is_split:
            return None  # served whole though placed split: a failed prefill, a retry, the request's reason
        # From its placement: the hold's wait is not the placement's to answer for.
        return Measured(t.first_byte - t.arrived - self.held_s, t.gaps_sum / t.num_gaps)
