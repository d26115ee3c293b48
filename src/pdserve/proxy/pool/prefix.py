"""Prefix-cache-aware routing: send a prompt where its leading blocks are likely cached already.

vLLM caches KV in blocks of ``block_size`` tokens, each keyed by a hash of its tokens chained to the
hash of the block before it, so a block is reused only behind the very same prefix. The proxy cannot
see those caches; it keeps its own record of which block hashes it sent to each instance
(``PrefixIndex``) and treats that as the instance's cache. Both sides of a PD request end up holding the
prompt: prefill computes it, and decode pulls it into its own blocks, which vLLM then caches as if it
had computed them. So the same index shape serves prefill routing, decode routing, and the decision to
skip prefill altogether (``should_skip_prefill``).

The record is an estimate: vLLM evicts under memory pressure and forgets everything on restart, and the
proxy learns of neither. A wrong estimate costs a cache miss, never a wrong answer.

Pure logic, no HTTP: candidates are the same plain objects routing.py's policies take. The hashes
are blocks.py's, over the proxy's own token ids (tokens.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.proxy.pool.routing import C, LeastLoaded, Pick, load_score


class PrefixIndex:
    """Per instance URL, the block hashes the proxy sent there, at most ``max_blocks_per_instance``,
    least recently used evicted first.

    Set the bound near an instance's KV capacity in blocks (vLLM logs it at start as the number of
    GPU/CPU blocks): a larger bound remembers prefixes the instance has already evicted.
    """

    def __init__(self, max_blocks_per_instance: int = 200_000) -> None:
        if max_blocks_per_instance < 1:
            raise ValueError(f"max_blocks_per_instance must be >= 1, got {max_blocks_per_instance}")
        self.max_blocks_per_instance = max_blocks_per_instance
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def match_blocks(self, url: str, hashes: Sequence[int]) -> int:
        """How many of the leading ``hashes`` the instance holds: its cache hit, in blocks."""
        held = self._blocks.get(url)
        if not held:
            return 0
        num_matched = 0
        for h in hashes:
            if h not in held:
                break
            num_matched += 1
        return num_matched

    def record(self, url: str, hashes: Sequence[int]) -> None:
        """The instance now holds these blocks.

        They are touched last block first, so a prompt's head is the most recently used and its tail is
        evicted before it, as vLLM frees a finished request's blocks tail first. Evicting a head first
        would strand its tail: unreachable by ``match_blocks`` yet taking room.
        """
        held = self._blocks.setdefault(url, OrderedDict())
        for h in reversed(hashes):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        while len(held) > self.max_blocks_per_instance:
            held.popitem(last=False)

    def forget(self, url: str) -> None:
        """The instance is gone or restarted: its cache is empty."""
        self._blocks.pop(url, None)

    def num_blocks(self, url: str) -> int:
        return len(self._blocks.get(url, ()))


class PrefixAware:
    """The candidate where the prompt would wait least, counting cached tokens as saved work.

    Each candidate scores ``cached_tokens - load_cost_tokens * load_score(c)``: the prompt tokens it
    would not recompute, minus the work queued ahead of the request there, valued at ``load_cost_tokens``
    prompt tokens per request ahead. So a cached prefix keeps a prompt on its instance until that
    instance has ``cached_tokens / load_cost_tokens`` more requests ahead than the idlest one; a hot
    prefix then spills onto a second instance, which caches it too. Set ``load_cost_tokens`` near the
    mean *uncached* prompt length of the workload: lower makes routing stickier (better hit rate, more
    queueing behind hot prefixes), higher makes it closer to least-loaded. The default, 256, suits chat
    turns of a few hundred new tokens behind long shared system prompts.

    With no match anywhere this is least-loaded; ties go round robin so equal instances share work.
    The chosen instance's blocks are recorded at once, not after prefill succeeds: vLLM caches a block
    as soon as it is scheduled, so a request right behind this one already hits it there.
    """

    def __init__(
        self, block_size: int = 16, load_cost_tokens: float = 256.0, max_blocks_per_instance: int = 200_000
    ) -> None:
        if block_size < 1 or load_cost_tokens < 0:
            raise ValueError("block_size must be >= 1 and load_cost_tokens >= 0")
        self.block_size = block_size
        self.load_cost_tokens = load_cost_tokens
        self.index = PrefixIndex(max_blocks_per_instance)
        self._counter = itertools.count()
        self._least_loaded = LeastLoaded()

    wants_prompt = True

    def pick(self, candidates: Sequence[C], prompt: Sequence[int] | None = None) -> Pick[C]:
        """The choice and its estimated cache hit in tokens, as it was *before* this request's blocks
        were recorded there (asking ``num_cached_tokens`` afterwards would count them as cached).
        Without a prompt (none readable, or no tokenizer): least loaded."""
        if not prompt:
            return self._least_loaded.pick(candidates)
        if not candidates:
            raise LookupError("no instance to choose from")
        start = next(self._counter) % len(candidates)
        best, best_cached, best_score = candidates[start], 0, float("-inf")
        for i in range(len(candidates)):
            candidate = candidates[(start + i) % len(candidates)]
            cached_tokens = self.index.match_blocks(candidate.url, prompt) * self.block_size
            score = cached_tokens - self.load_cost_tokens * load_score(candidate)
            if score > best_score:
                best, best_cached, best_score = candidate, cached_tokens, score
        self.index.record(best.url, prompt)
        return Pick(best, best_cached)

    def forget(self, url: str) -> None:
        self.index.forget(url)

    def learn(self, url: str, prompt: Sequence[int]) -> None:
        self.index.record(url, prompt)

    def num_cached_tokens(self, url: str, hashes: Sequence[int]) -> int:
        """The instance's estimated cache hit for this prompt, in tokens (whole blocks only)."""
        return self.index.match_blocks(url, hashes) * self.block_size


def should_skip_prefill(num_prompt_tokens: int, num_cached_tokens_estimate: int, threshold: int) -> bool:
    """Whether decode should compute this prompt itself instead of pulling it from a prefill instance.

    Splitting a request costs a fixed price whatever the prompt: a prefill round trip, a second
    scheduling, and a NIXL pull before decode's first token. It pays off only when prefill takes real
    compute off decode, and decode's compute is the part of the prompt *decode* does not hold already:
    ``num_prompt_tokens - num_cached_tokens_estimate``, the estimate being the chosen decode instance's
    match in the decode policy's index (every PD request leaves its prompt's KV in decode's cache after
    the pull, so a conversation's next turn usually finds most of its prompt there). What prefill holds
    does not matter here: a prefill hit makes prefill cheap, not the split. Below ``threshold`` uncached
    tokens, decode computing the rest costs its running streams one short step; that is the trade.

    ``threshold <= 0`` never skips. Use it only with a prompt the proxy could read: an unknown prompt
    is not a short one.
    """
    if threshold <= 0:
        return False
    return num_prompt_tokens - max(0, num_cached_tokens_estimate) < threshold
