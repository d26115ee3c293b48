"""The KV block pool: fixed-size blocks, ref counts and a prefix cache keyed by block hash (vLLM V1's shape).

A block's hash chains its parent's hash with its own token ids, so equal hashes mean equal prefixes. Only
FULL blocks are hashed and shared. A block whose last user leaves goes to the back of the free queue but
keeps its hash: until it reaches the front and is reused (evicted), a later request with the same prefix
can take it back. That makes the free queue an LRU of cached blocks, as in vLLM.

A block can also be *stale*: filled by a pull of blocks the remote holder had already released (its
lease ran out), so its contents are some other prompt's. vLLM caches such blocks under the prompt's
hashes like any other pulled block, so a later request with that prefix reads them too, until the block
is evicted and rewritten.

Resources are check-then-commit: ``can_allocate`` answers without changing anything, ``allocate`` then
cannot fail. A lookup never covers a whole sequence: like vLLM, the last token is always recomputed, since
computing it is what produces the next token's logits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.blocks import ROOT_HASH, extend_block_hashes, root_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks  # set while the block is in the prefix cache
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Every block with no user, oldest first; popping the front evicts. Dict order gives O(1) removal
        # when a cache hit takes a block back out of the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}  # request id -> its blocks, in token order
        self._num_hashed: dict[str, int] = {}  # request id -> how many of its leading blocks are cached
        self._stale: set[int] = set()  # block ids whose contents are not what their hash says
        # Counted in tokens, like vllm:prefix_cache_queries / vllm:prefix_cache_hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # --- Reading ------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request uses, cached ones included (they can be evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_slots(self, request_id: str) -> int:
        """Tokens the request's blocks can hold."""
        return len(self._tables.get(request_id, ())) * self.block_size

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def has_stale(self, block_ids: Sequence[int]) -> bool:
        return any(b in self._stale for b in block_ids)

    @property
    def num_stale_blocks(self) -> int:
        return len(self._stale)

    def hash_blocks(self, token_ids: Sequence[int], hashes: list[int], salt: str | None = None) -> None:
        """Extend ``hashes`` with the hashes of the full blocks of ``token_ids`` it does not cover yet;
        the request's ``cache_salt`` roots the chain."""
        extend_block_hashes(token_ids, self.block_size, hashes, ROOT_HASH if hashes else root_hash(salt))

    def lookup(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """The cached blocks of the longest cached prefix of a ``num_tokens``-token sequence.

        Stops one token short of the whole sequence, so at least its last token is computed.
        """
        hits: list[int] = []
        for i in range((num_tokens - 1) // self.block_size):
            if i >= len(hashes):
                break
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_new_blocks(self, num_tokens: int, request_id: str | None = None, num_hits: int = 0) -> int:
        """Blocks ``request_id`` (or a new request) must add to hold ``num_tokens`` tokens."""
        have = len(self._tables.get(request_id, ())) if request_id is not None else 0
        return max(0, cdiv(num_tokens, self.block_size) - have - num_hits)

    def can_allocate(self, num_tokens: int, request_id: str | None = None, hits: Sequence[int] = ()) -> bool:
        """Whether the request can grow to ``num_tokens`` tokens (reusing ``hits`` first); changes nothing."""
        # A hit block nobody uses sits in the free queue, so taking it back costs free capacity too.
        num_idle_hits = sum(1 for b in hits if self._ref[b] == 0)
        return self.num_new_blocks(num_tokens, request_id, len(hits)) + num_idle_hits <= len(self._free)

    # --- Changing ----------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, hits: Sequence[int] = ()) -> list[int]:
        """Grow the request's block table to hold ``num_tokens`` tokens; call ``can_allocate`` first."""
        if not self.can_allocate(num_tokens, request_id, hits):
            raise RuntimeError(f"allocate({request_id!r}, {num_tokens}) without capacity; check first")
        num_new = self.num_new_blocks(num_tokens, request_id, len(hits))
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = []
            self._num_hashed[request_id] = len(hits)
        elif hits:
            raise RuntimeError(f"prefix hits for {request_id!r}, which already has blocks")
        for block_id in hits:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1
            table.append(block_id)
        for _ in range(num_new):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self._hash[block_id]
            if block_hash is not None:
                del self._cached[block_hash]
                self._hash[block_id] = None
                self.num_evictions += 1
            self._stale.discard(block_id)  # rewritten by its new user
            self._ref[block_id] = 1
            table.append(block_id)
        return table

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (vLLM's POST /reset_prefix_cache): no later request reuses a block
        through the cache; running requests keep their blocks. The number of hashes forgotten."""
        num = len(self._cached)
        for block_id in self._cached.values():
            self._hash[block_id] = None
        self._cached.clear()
        for request_id, table in self._tables.items():  # their blocks are theirs alone now
            self._num_hashed[request_id] = len(table)
        return num

    def mark_stale(self, request_id: str, first_token: int, end_token: int) -> None:
        """The request's tokens ``first_token`` up to ``end_token`` were filled from released remote
        blocks: the blocks holding them are stale."""
        table = self._tables.get(request_id, [])
        self._stale.update(table[first_token // self.block_size : cdiv(end_token, self.block_size)])

    def cache_blocks(self, request_id: str, hashes: Sequence[int], num_computed_tokens: int) -> None:
        """Put the request's blocks that are now full and computed into the prefix cache."""
        table = self._tables[request_id]
        start = self._num_hashed[request_id]
        end = min(num_computed_tokens // self.block_size, len(hashes), len(table))
        for i in range(start, end):
            block_hash, block_id = hashes[i], table[i]
            # Two requests may compute the same prefix at once; the first one's block is the shared one.
            if block_hash not in self._cached and self._hash[block_id] is None:
                self._cached[block_hash] = block_id
                self._hash[block_id] = block_hash
        if end > start:
            self._num_hashed[request_id] = end

    def free(self, request_id: str) -> None:
        """Drop the request's hold on its blocks; cached ones stay findable until evicted."""
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if table is None:
            return
        # Tail first, as vLLM does: a prefix's last blocks are the least likely to be shared, so they
        # should be the first evicted.
        for block_id in reversed(table):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
