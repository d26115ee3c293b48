"""The simulator's token model: which token a prompt's sequence emits at each position, and a logprob per
(context, token) that the teacher-forced answer oracle compares.

A token's logprob is a hash of everything before it (a rolling digest of the token ids) and of the token
itself, so the sampled logprobs of a PD answer equal the prompt logprobs of the same tokens computed
afresh on any instance, exactly, unless decode computed on wrong KV: a sequence that read another
prompt's (or released) blocks starts from another digest and every logprob it reports differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

_MASK: Final = (1 << 64) - 1
START: Final = 0x243F6A8885A308D3  # the digest of an empty context
WRONG_KV: Final = 0x13198A2E03707344  # what a sequence computed on wrong KV mixes into its digest
_LOWEST: Final = 8.0  # logprobs lie in (-8, 0]
FIRST_TOKEN_ID: Final = 100  # ids below are left for the HTTP layer's special tokens


def output_token(seed: int, prompt_hash: int, index: int, vocab_size: int) -> int:
    """The ``index``-th output token of a prompt: a splitmix64 mix, cheap and the same in every process."""
    x = (prompt_hash ^ (seed * 0xD6E8FEB86659FD93) ^ (index * 0x9E3779B97F4A7C15)) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return FIRST_TOKEN_ID + (x ^ (x >> 31)) % vocab_size


def _mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def extend(digest: int, token_id: int) -> int:
    return _mix(digest ^ ((token_id * 0x9E3779B97F4A7C15) & _MASK))


def digest_of(token_ids: Iterable[int], digest: int = START) -> int:
    for token_id in token_ids:
        digest = extend(digest, token_id)
    return digest


def logprob(digest: int, token_id: int) -> float:
    """The logprob of ``token_id`` after a context with this digest."""
    x = _mix(digest ^ ((token_id * 0xD6E8FEB86659FD93) & _MASK) ^ 0x5851F42D4C957F2D)
    return -_LOWEST * (x >> 11) / float(1 << 53)


def step(digest: int, token_id: int, is_asked: bool) -> tuple[float | None, int]:
    """A generated token's logprob (None when not asked for) and the digest with it appended."""
    if not is_asked:
        return None, digest
    return logprob(digest, token_id), extend(digest, token_id)


def prompt_logprobs(token_ids: Iterable[int]) -> list[float | None]:
    """Each prompt position's logprob given the positions before it; the first has none (as vLLM)."""
    out: list[float | None] = []
    digest = START
    for i, token_id in enumerate(token_ids):
        out.append(None if i == 0 else logprob(digest, token_id))
        digest = extend(digest, token_id)
    return out
