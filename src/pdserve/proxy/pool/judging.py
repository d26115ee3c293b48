"""The elastic router's judgement of one request by its own length and the queues it would join, beside
the layout's plan (elastic.py), which reads the traffic's averages.

Where every prompt has one length, a phase's mean is every request's length and the plan's split-or-not
is right for each. Where short chat turns mix with 3,000-token retrieval prompts and agents' 5,000-token
ones, the mean is nobody's: a split layout sends the short turns through the prefill side behind the long
prompts (their TTFT pays the long ones' queue). So:

- **which prompts stay whole on a split layout** (``whole_below``): a decode-side instance can compute
  prompts between its decode steps as long as their cost keeps its streams' steps within the TPOT
  objective. Its spare share of time is ``1 - step/TPOT`` (the step the cost model predicts at the
  plan's load); a quarter of it, over the per-token prefill cost, is the prompt tokens a second it may take.
  The recent prompts, shortest first, fill that budget: those that fit are served whole on a decode,
  the rest split; and none whose own prefill takes longer than the TPOT objective, which would stall
  every stream there by a token's whole allowance at once. Without a TPOT objective only the prompts
  cheaper than a decode step stay whole.

- **what a whole stream's TPOT is judged against** (``stretch``): the step it joined, plus the prompts its
  instance computed in its lifetime, counted when it ends: those placed there after it (FCFS: the ones
  before it were computed before its first token) and computed, by the step costs, before it ended.

Pure arithmetic on what the router counts; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdserve.costmodel import Costs, step_share

# The share of a decode-side instance's spare time (within its TPOT objective) that whole prompts may
# take: the rest absorbs the load estimate's error and the batches' Poisson swings.
_SPARE_FOR_PROMPTS = 0.25


def whole_below(
    costs: Costs, lengths: Sequence[int], span_s: float, num_decode: int, step_s: float, tpot_s: float | None
) -> int:
    """The longest prompt (tokens) a split layout serves whole on a decode-side instance: the recent
    prompts (``lengths`` over ``span_s``), shortest first, while their tokens a second fit the decode
    side's budget; at least those cheaper than a decode step."""
    cheap = cheap_below(costs)
    if tpot_s is None or not costs.prefill_per_token_s > 0 or not span_s > 0 or math.isinf(step_s):
        return cheap
    spare = max(0.0, 1 - step_s / tpot_s)
    budget = _SPARE_FOR_PROMPTS * spare / costs.prefill_per_token_s * num_decode  # tokens/s
    # One prompt may stretch its instance's step by at most the objective: a longer one stalls every
    # stream there by more than a token's whole allowance at once.
    cap = math.floor(tpot_s / costs.prefill_per_token_s)
    used, longest = 0.0, cheap
    for n in sorted(lengths):
        used += n / span_s
        if used > budget or n > cap:
            break
        longest = max(longest, n)
    return longest


def cheap_below(costs: Costs) -> int:
    """The longest prompt that costs less to compute than a decode step."""
    if not costs.prefill_per_token_s > 0:
        return 0
    return max(0, math.ceil(costs.step_base_s / costs.prefill_per_token_s) - 1)


def alone(costs: Costs, is_split: bool, prompt_tokens: int, output_len: int) -> tuple[float, float]:
    """The model's (TTFT, TPOT) of a lone request on an idle pool: nothing queued ahead, a batch of one
    (what a start-up measurement is compared to)."""
    steps = -(-prompt_tokens // costs.max_num_batched_tokens)
    step = costs.step_base_s + step_share(costs, prompt_tokens, output_len, whole=False)
    compute = steps * costs.step_base_s + costs.prefill_per_token_s * prompt_tokens
    if not is_split:
        return costs.lone_request_overhead_s + compute + step, step
    blocks = -(-prompt_tokens // costs.block_size)
    return 2 * costs.lone_request_overhead_s + compute + costs.pull_seconds(blocks) + 2 * step, step


def stretch(costs: Costs, prompts: Sequence[tuple[float, float, int]], placed_at: float, now: float,
            life_s: float, tpot_s: float) -> float:  # fmt: skip
    """What the prompts an instance computed in a whole stream's lifetime added to each of its steps, by
    the step costs: ``prompts`` (placed at, computed by, tokens; in the order placed) placed after the
    stream (``placed_at``) and computed by ``now``, their cost spread over its gaps between tokens
    (``life_s``, its first token to its last, over ``tpot_s``, the mean gap it measured)."""
    if not life_s > 0 or not tpot_s > 0:
        return 0.0
    tokens = 0
    for at, computed_by, num in reversed(prompts):
        if at <= placed_at:
            break
        if computed_by <= now:
            tokens += num
    return costs.prefill_per_token_s * tokens * tpot_s / life_s
