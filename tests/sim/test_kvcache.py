"""The KV block pool: prefix sharing, its token counters, LRU eviction and check-then-commit."""

from __future__ import annotations

import pytest

from pdserve.sim.kvcache import KVCache

BS = 4


def hashes_of(kv: KVCache, tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    kv.hash_blocks(tokens, hashes)
    return hashes


def admit(kv: KVCache, request_id: str, tokens: list[int]) -> int:
    """Admit a request as the scheduler does and compute all of it; the number of prefix-hit tokens."""
    hashes = hashes_of(kv, tokens)
    hits = kv.lookup(hashes, len(tokens))
    assert kv.can_allocate(len(tokens), request_id, hits)
    kv.allocate(request_id, len(tokens), hits)
    kv.record_query(len(tokens), len(hits) * BS)
    kv.cache_blocks(request_id, hashes, len(tokens))
    return len(hits) * BS


def test_shared_prefix_is_a_hit_counted_in_tokens() -> None:
    kv = KVCache(num_blocks=16, block_size=BS)
    assert admit(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 0
    assert admit(kv, "b", [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97]) == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    assert kv.blocks("a")[:2] == kv.blocks("b")[:2]
    assert kv.ref_count(kv.blocks("a")[0]) == 2


def test_the_last_prompt_token_is_always_recomputed() -> None:
    kv = KVCache(num_blocks=16, block_size=BS)
    admit(kv, "a", list(range(8)))
    # Both blocks are cached, but computing the last token is what yields the first output token.
    assert admit(kv, "b", list(range(8))) == 4
    assert admit(kv, "c", list(range(9))) == 8


def test_only_full_blocks_are_shared() -> None:
    kv = KVCache(num_blocks=16, block_size=BS)
    admit(kv, "a", [1, 2, 3, 4, 5, 6])
    assert kv.num_cached_blocks == 1
    assert admit(kv, "b", [1, 2, 3, 4, 5, 6, 7]) == 4


def test_equal_blocks_after_different_prefixes_do_not_match() -> None:
    kv = KVCache(num_blocks=16, block_size=BS)
    admit(kv, "a", [1, 1, 1, 1, 5, 5, 5, 5, 0])
    assert admit(kv, "b", [2, 2, 2, 2, 5, 5, 5, 5, 0]) == 0


def test_freed_blocks_stay_cached_and_are_not_in_use() -> None:
    kv = KVCache(num_blocks=8, block_size=BS)
    admit(kv, "a", list(range(9)))
    assert kv.usage == pytest.approx(3 / 8)
    kv.free("a")
    assert kv.usage == 0.0
    assert admit(kv, "b", list(range(9))) == 8


def test_eviction_reuses_the_least_recently_freed_blocks_first() -> None:
    kv = KVCache(num_blocks=6, block_size=BS)
    old, new = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24]
    admit(kv, "old", old)
    admit(kv, "new", new)
    kv.free("old")
    kv.free("new")
    admit(kv, "filler", list(range(30, 46)))  # 4 blocks: the 2 never used, then the 2 freed first
    assert kv.num_evictions == 1  # "old"'s full block; its partial block was never cached
    assert kv.lookup(hashes_of(kv, old), len(old)) == []
    assert len(kv.lookup(hashes_of(kv, new), len(new))) == 1


def test_a_requests_tail_blocks_are_evicted_before_its_head() -> None:
    kv = KVCache(num_blocks=3, block_size=BS)
    admit(kv, "a", list(range(12)))
    kv.free("a")
    admit(kv, "b", [99])  # takes one block: must be a's last, keeping the shareable head cached
    assert len(kv.lookup(hashes_of(kv, list(range(13))), 13)) == 2


def test_can_allocate_changes_nothing_and_allocate_without_room_fails() -> None:
    kv = KVCache(num_blocks=2, block_size=BS)
    assert kv.can_allocate(8)
    assert not kv.can_allocate(9)
    assert kv.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="check first"):
        kv.allocate("a", 9)


def test_an_idle_hit_block_needs_free_capacity_to_take_back() -> None:
    kv = KVCache(num_blocks=3, block_size=BS)
    admit(kv, "a", list(range(5)))
    kv.free("a")
    admit(kv, "x", [7])  # 1 block in use; a's cached block and one other are free
    hashes = hashes_of(kv, list(range(12)))
    hits = kv.lookup(hashes, 12)
    assert len(hits) == 1
    assert not kv.can_allocate(12, "b", hits)  # the hit plus 2 new blocks > 2 free
    assert kv.can_allocate(8, "b", hits)


def test_growing_a_request_takes_one_more_block_when_its_last_is_full() -> None:
    kv = KVCache(num_blocks=4, block_size=BS)
    kv.allocate("a", 4)
    assert kv.num_slots("a") == 4
    assert kv.num_new_blocks(5, "a") == 1
    kv.allocate("a", 5)
    assert kv.num_slots("a") == 8
    assert kv.usage == 0.5
