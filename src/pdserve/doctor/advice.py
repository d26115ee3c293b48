"""Does the split pay on this pair? The arithmetic and the words, from one measured handoff.

Pure functions of numbers the canary measured (canary.py), so the advice is unit-tested with plain data.

The comparison: what it takes to move a prompt's KV from prefill to decode (NIXL's own transfer time for
the bytes it moved) against what it takes decode to compute that KV itself (a prefill-only request of the
same prompt on decode, with a fresh cache). When moving costs as much as computing, disaggregation cannot
win on this link: every request pays the move, and the work it takes off decode is no larger. When moving
is cheap, the link is not what stands in the way; whether the split then pays depends on load (prefill
steps stalling decode steps), which one canary at no load cannot show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

# Below this a single transfer is dominated by fixed costs (posting, notification, one round trip),
# so bytes / time understates what the link could carry for a real prompt.
SMALL_TRANSFER_BYTES: Final = 16 * 2**20


@dataclass(frozen=True)
class Handoff:
    """One canary handoff, measured. Times in seconds; counters are decode's deltas over the canary."""

    prompt_tokens: int
    num_blocks: int  # KV blocks prefill named in its params
    block_size: int | None  # tokens per block (cache_config_info), None if not exported
    prefill_s: float  # the prefill call as the proxy makes it (max_tokens=1, KV kept for decode)
    decode_s: float  # the decode call with prefill's params: pull + generation
    alone_s: float  # the same request served by decode alone, fresh cache
    local_prefill_s: float  # max_tokens=1 of the same prompt on decode, fresh cache: prefilling here
    num_transfers: float  # vllm:nixl_xfer_time_seconds_count delta (1 for the canary alone)
    num_failed: float  # vllm:nixl_num_failed_transfers_total delta
    bytes: float  # vllm:nixl_bytes_transferred_sum delta
    xfer_s: float  # vllm:nixl_xfer_time_seconds_sum delta: NIXL's own clock, post to done
    num_descriptors: float | None  # vllm:nixl_num_descriptors_sum delta, if exported

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second, or None when nothing (or no time) was measured."""
        return self.bytes / self.xfer_s if self.bytes > 0 and self.xfer_s > 0 else None

    @property
    def bytes_per_token(self) -> float | None:
        """KV bytes per prompt token slot (whole blocks move, so per block-size token when known)."""
        slots = self.num_blocks * self.block_size if self.block_size else self.prompt_tokens
        return (
            self.bytes / self.num_transfers / slots
            if self.bytes > 0 and slots and self.num_transfers
            else None
        )

    @property
    def added_s(self) -> float:
        """What the split added to this request at no load: prefill call + decode call − decode alone."""
        return self.prefill_s + self.decode_s - self.alone_s


@dataclass(frozen=True)
class Verdict:
    pays: bool  # False: moving the KV takes at least as long as computing it on decode
    bandwidth: float  # bytes per second, over the transfers counted during the canary
    one_bytes: float  # one canary's KV (per transfer, if decode did several meanwhile)
    move_s: float  # time to move it
    ratio: float  # move_s / local_prefill_s
    lines: tuple[str, ...]  # the advice, in plain words


def size(num_bytes: float) -> str:
    """1.4 MB, 250 MB, 3.1 GB: decimal units, as link speeds are quoted."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def rate(bytes_per_s: float) -> str:
    """GiB/s, as NIXL benchmarks quote KV transfer rates (0.5 GiB/s, 3.2 GiB/s); MiB/s for slow links."""
    gib = bytes_per_s / 2**30
    return f"{gib:.2g} GiB/s" if gib >= 0.1 else f"{bytes_per_s / 2**20:.3g} MiB/s"


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def judge(h: Handoff) -> Verdict | None:
    """The verdict, or None when the canary moved nothing to judge by."""
    bandwidth = h.bandwidth
    if bandwidth is None or h.num_transfers < 1 or h.local_prefill_s <= 0:
        return None
    one_bytes = h.bytes / h.num_transfers
    move_s = h.xfer_s / h.num_transfers
    ratio = move_s / h.local_prefill_s
    pays = ratio < 1.0
    per_token = h.bytes_per_token
    lines = [
        f"KV moves at {rate(bandwidth)} on this pair; a {h.prompt_tokens:,}-token prompt of this model is "
        f"{size(one_bytes)}"
        + (f" ({size(per_token)} per token)" if per_token else "")
        + f": {duration(move_s)} to move, {duration(h.local_prefill_s)} to prefill here."
    ]
    if one_bytes < SMALL_TRANSFER_BYTES:
        lines.append(
            f"(One {size(one_bytes)} transfer is mostly fixed cost: the link may carry more for longer "
            "prompts; the rate above is what this prompt size gets.)"
        )
    if not pays:
        lines.append(
            f"Moving the KV takes {ratio:.1f}x as long as computing it: disaggregation costs more than "
            "it saves on this link. Serve colocated, or give NIXL a faster transport."
        )
    elif ratio >= 0.5:
        lines.append(
            f"Moving the KV takes {ratio:.0%} of the time computing it takes: the split keeps little of "
            "what it saves decode; it pays only if prefill steps would otherwise stall many decodes."
        )
    else:
        lines.append(
            f"Moving the KV takes {ratio:.1%} of the time computing it takes: the link is not what stands "
            "in the way. Whether the split pays depends on load (prefill steps stalling decode steps), "
            "which one canary at no load does not show."
        )
    sign = "+" if h.added_s >= 0 else "-"
    lines.append(
        f"At no load the split changed this request's time by {sign}{duration(abs(h.added_s))} "
        f"(prefill call {duration(h.prefill_s)} + decode {duration(h.decode_s)}, against "
        f"{duration(h.alone_s)} for decode alone)."
    )
    return Verdict(pays, bandwidth, one_bytes, move_s, ratio, tuple(lines))


def prompt_budget(target_tokens: int, max_model_len: int | None, max_tokens: int) -> int:
    """Canary prompt length: the target, kept within max_model_len with room for the answer."""
    if max_model_len is None:
        return target_tokens
    return max(16, min(target_tokens, max_model_len - max_tokens - 8))


def repeats_for(target_tokens: int, tokens_per_repeat: float, overhead_tokens: int = 0) -> int:
    """How many times to repeat a sentence of ``tokens_per_repeat`` tokens to reach about the target."""
    if tokens_per_repeat <= 0:
        return 1
    return max(1, math.floor((target_tokens - overhead_tokens) / tokens_per_repeat))
