"""The elastic router's decode-side batches: the requests each instance runs, what they add to its steps,
and how many it runs within the TPOT objective (``cap``), which the hold (holding.py) waits on.

Each request adds its step share to the instance that decodes it, from its placement to its end
(``costmodel.step_share``: its own share, its context half grown, and its prompt spread over its answer
when that instance computes it). An instance's cap is the most requests whose steps stay within the
objective at the plan's quantile (``costmodel.batch_within``), at the larger of two per-request shares:

- the mean share of what it runs now: the plan's cap counts the window's mean lengths, the same for
  every instance, so one running short chat streams was held where it had room, and one holding
  5,000-token contexts took more than it could keep within the objective;
- the arrivals' mean share, each weighted by its answer's length (a stream stays as many steps as it
  has tokens, so this is the batch they make), forgotten over the plan's window (``memory_s``: each
  arrival's weight falls e-fold a window; of 2, 3.5, 5 and 10 s on the mixed traces, 2 let agent bursts'
  contexts in behind a cheap batch, and 10 did best by a run): a batch of short chat streams is no
  promise for the long answers arriving now, which stay far longer. With the first alone, the
  long-answer phase after a chat-heavy one admitted as many long answers as the chat allowed, and
  their TPOT p90 rose to 11.5 ms (seed 5 of the mixed traces, TTFT 1 s / TPOT 10 ms).

Over the mixed traces (seeds 0-7 x 4 SLO pairs) this put 23 runs within 5 % of the best fixed layout in
every phase where the plan's cap put 19 (BENCHMARKS.md). The arrivals count their prompts as computed
where they decode by the layout they meet: all of them colocated, those up to the router's
``whole_below`` on a split layout. No clock but the one given.
"""

from __future__ import annotations

import math

from pdserve.costmodel import Costs, batch_within, step_share


class DecodeBatches:
    """The one owner of the requests each instance runs for the router, of their step shares, and of the
    arrivals' mix, forgotten over ``memory_s``. ``costs`` None: counts only, every cap the plan's."""

    def __init__(self, costs: Costs | None, tpot_ms: float | None, memory_s: float) -> None:
        self._costs = costs
        self._memory_s = memory_s
        self._tpot_s = tpot_ms / 1000 if tpot_ms is not None else None
        self._counts: dict[str, int] = {}
        self._shares: dict[str, float] = {}  # the shares of what each runs, summed (seconds a step)
        # Decayed sums over the arrivals: their decode shares times their answers' lengths, their
        # prompts' compute (all; those whole on a split layout), their answers' lengths; and when.
        self._decode = self._prompts = self._whole_prompts = self._weight = 0.0
        self._at = 0.0

    def count(self, url: str) -> int:
        """The requests ``url`` decodes (or serves whole) now."""
        return self._counts.get(url, 0)

    def share(self, prompt_tokens: int, output_len: int, whole: bool) -> float:
        """What a request adds to each step of the instance that decodes it (0 without step costs)."""
        if self._costs is None:
            return 0.0
        return step_share(self._costs, prompt_tokens, output_len, whole)

    def arrived(self, now: float, prompt_tokens: int, output_len: int, whole_below: int) -> None:
        """A request arrived (placed now or held): its share joins the arrivals' mix."""
        if self._costs is None:
            return
        decay = math.exp(-(now - self._at) / self._memory_s)
        prompt = self._costs.prefill_per_token_s * prompt_tokens
        decode = step_share(self._costs, prompt_tokens, output_len, False)
        self._decode = self._decode * decay + decode * output_len
        self._prompts = self._prompts * decay + prompt
        self._whole_prompts = self._whole_prompts * decay + (prompt if prompt_tokens <= whole_below else 0.0)
        self._weight = self._weight * decay + output_len
        self._at = now

    def begin(self, url: str, share: float) -> None:
        self._counts[url] = self._counts.get(url, 0) + 1
        self._shares[url] = self._shares.get(url, 0.0) + share

    def end(self, url: str, share: float) -> None:
        left = max(0, self._counts.get(url, 0) - 1)
        self._counts[url] = left
        # Nothing left, nothing owed: float sums of many shares would not come back to zero exactly.
        self._shares[url] = self._shares.get(url, 0.0) - share if left else 0.0

    def forget(self, url: str) -> None:
        self._counts.pop(url, None)
        self._shares.pop(url, None)

    def cap(self, url: str, is_split: bool, z: float, traffic_share: float, planned: float) -> float:
        """The most requests ``url`` runs within the TPOT objective on a layout that ``is_split`` or not,
        at the quantile ``z``, for this router's ``traffic_share`` of the pool; ``planned`` (the plan's
        cap) while it runs none, or without step costs or objective."""
        n = self.count(url)
        if n == 0 or self._costs is None or self._tpot_s is None or math.isinf(planned):
            return planned
        coming = 0.0
        if self._weight > 0:
            coming = (self._decode + (self._whole_prompts if is_split else self._prompts)) / self._weight
        cap = batch_within(self._costs, self._tpot_s, max(self._shares.get(url, 0.0) / n, coming), z)
        return max(1.0, math.floor(cap * traffic_share)) if cap < math.inf else math.inf
