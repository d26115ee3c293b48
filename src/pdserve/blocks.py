"""Chained KV block hashes, as vLLM keys its prefix cache: a block's hash covers its own tokens and,
through its parent's hash, every token before it, so equal i-th hashes mean equal first i+1 blocks.

One hasher for the proxy's prefix index (proxy/pool/prefix.py) and the simulator's block pool (sim/kvcache.py).
Only full blocks are hashed: a trailing partial block is never cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

ROOT_HASH: Final = 0x5EED  # parent of a prompt's first block when the request has no cache salt


def root_hash(salt: str | None = None) -> int:
    """The parent of the first block. vLLM shares no cache between different ``cache_salt`` values,
    and neither does a hash chain that starts from the salt."""
    if salt is None:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def extend_block_hashes(
    token_ids: Sequence[int], block_size: int, hashes: list[int], root: int = ROOT_HASH
) -> None:
    """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` it does not cover yet.

    Incremental, so a sequence that grows by a token at a time is hashed once per block. Hashes are
    Python's tuple hash (64 bits, the same in every process for ints): a collision costs a cache miss
    in the proxy's estimate, or a wrong hit in the simulator's model, never a wrong answer.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chained hashes of every full block of ``token_ids``."""
    hashes: list[int] = []
    extend_block_hashes(token_ids, block_size, hashes, root_hash(salt))
    return hashes
