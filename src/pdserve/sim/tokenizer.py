"""The simulator's tokenizer: deterministic text ↔ token ids, a chat template, token counts.

No model vocabulary is needed to be faithful at the HTTP level: what matters is that the same text always
gives the same ids (so prefix caching and P→D equality behave as in vLLM), in every process, fast.

- ``encode``: words, and single punctuation marks, each become one id by a stable hash (crc32) into
  ``[FIRST_TOKEN_ID, FIRST_TOKEN_ID + VOCAB_SIZE)``. Python's ``hash`` of a str is salted per process,
  so it would break cross-process P→D; crc32 is not.
- ``decode``: every id is shown as a word (with its leading space) from a fixed list. Output text is for
  humans and stop strings only; ``decode(encode(text))`` is not ``text``.
- Ids below ``FIRST_TOKEN_ID`` are left for special tokens, as the engine core does for its outputs.
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Final

import orjson

from pdserve.errors import ChatTemplateError

FIRST_TOKEN_ID: Final = 100
VOCAB_SIZE: Final = 32000

_PIECE: Final = re.compile(r"\w+|[^\w\s]")

# Output tokens are shown as these words (ids map onto them modulo their number).
_WORD_TEXT: Final = """
the of and to in is was for on that with as by at from it an be this are or which were his had not
but have one all their has they been more other its into two first time after new can would who also
some only many over most when made such years may used between each city then three during about
world where state than these well him under them while because both known later however part area
could through people before water since any year until around same work high four several end name
along must small large early river system light house music life game form day family line off way
long back good great left right best south north east west old still number another five order power
point road air sound stone field tree garden window table paper story letter market station bridge
island valley forest cloud rain snow wind summer winter morning evening night moon star sun sea ship
train engine signal token block cache batch queue model layer value vector matrix page index memory
thread core green blue red yellow white black silver golden quiet bright gentle rapid simple clear
open round deep warm cold soft hard near far late tall wide narrow
"""
_WORDS: Final[tuple[str, ...]] = tuple(_WORD_TEXT.split())
_NUM_WORDS: Final = len(_WORDS)
_PIECES: Final[tuple[str, ...]] = tuple(" " + w for w in _WORDS)
_PIECES_JSON: Final[tuple[bytes, ...]] = tuple(orjson.dumps(p) for p in _PIECES)


@functools.lru_cache(maxsize=200_000)  # prompts repeat their words; crc32 per word is the hot cost
def _piece_id(piece: str) -> int:
    return FIRST_TOKEN_ID + zlib.crc32(piece.encode()) % VOCAB_SIZE


def encode(text: str) -> list[int]:
    return [_piece_id(p) for p in _PIECE.findall(text)]


def count_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


def piece(token_id: int) -> str:
    """The text of one output token: a word with its leading space."""
    return _PIECES[(token_id - FIRST_TOKEN_ID) % _NUM_WORDS]


def piece_json(token_id: int) -> bytes:
    """``piece(token_id)`` as a JSON string literal, ready to splice into a pre-encoded SSE chunk."""
    return _PIECES_JSON[(token_id - FIRST_TOKEN_ID) % _NUM_WORDS]


def decode(token_ids: Iterable[int]) -> str:
    return "".join(piece(t) for t in token_ids)


def _content_text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, str):
                texts.append(part)
        return "\n".join(texts)
    raise ChatTemplateError(
        f"message content must be a string or a list of parts, got {type(content).__name__}"
    )


def render_chat(messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages``, in a ChatML-like template (what the tiny model's template does)."""
    if not messages:
        raise ChatTemplateError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError("each message must be an object with a role and content")
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError("each message needs a string role")
        parts.append(f"<|{role}|>\n{_content_text(message.get('content'))}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
