"""Chained block hashes: the prefix identity both the proxy's index and the simulator's cache use."""

from __future__ import annotations

import pytest

from pdserve.blocks import block_hashes, extend_block_hashes, root_hash


def test_hashing_a_growing_sequence_block_by_block_equals_hashing_it_whole() -> None:
    tokens = list(range(100))
    grown: list[int] = []
    for end in range(1, len(tokens) + 1):
        extend_block_hashes(tokens[:end], 16, grown)
    assert grown == block_hashes(tokens, 16)
    assert len(grown) == 6  # 96 tokens in full blocks; the last 4 make no block


def test_a_salt_changes_every_block_and_no_salt_is_the_default_root() -> None:
    tokens = list(range(32))
    assert root_hash() != root_hash("tenant")
    assert set(block_hashes(tokens, 16, "tenant")).isdisjoint(block_hashes(tokens, 16))


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
