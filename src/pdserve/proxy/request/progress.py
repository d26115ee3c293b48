"""What a streamed answer has sent its client so far, kept cheaply enough to sit on every token's path.

A stream that may migrate (migrate.py) asks decode for ``return_token_ids``: vLLM then puts each event's
new token ids in its choice (``"token_ids":[...]``) and the prompt's on the first (``"prompt_token_ids":
[...]``). ``Progress.feed`` takes each chunk on its way to the client, cuts the id lists out of the bytes
(replaced by ``null``, which is exactly what vLLM writes when the client did not ask) and keeps the cut
slices; nothing is decoded until a migration needs the ids (``token_ids``).

Why bytes and not JSON: parsing and re-encoding every event would cost the relay more than everything
else it does per token. The cut is exact: a JSON string cannot hold a raw ``"`` (it is escaped), so no
token's text can fake ``"token_ids":[``, and an id list holds only digits and commas, so its first ``]``
ends it. A chunk that ends mid-event keeps its unfinished event back until the rest arrives, so a key or
a list is never cut by a chunk's edge.

Only what a migration would read is kept: the slices, the first event (the stream's id, model and shape),
the last event carrying ids (did it finish?), and, when stop strings or logprobs need the client's text,
every chunk sent.
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

from pdserve import sse

_IDS: Final = b'"token_ids":['
_PROMPT_IDS: Final = b'"prompt_token_ids":['
_END: Final = b"\n\n"
_IDS_LAST: Final = (
    b"]}]}\n\n"  # the ids end the choice, the choice the event: a token's event as vLLM writes it
)
_NULL_LAST: Final = b'"token_ids":null}]}\n\n'
_NULL_IDS: Final = b'"token_ids":null'
_SPLIT_IDS: Final = re.compile(rb'"token_ids":\[([0-9,]*)\]').split  # [before, ids, between, ids, …, after]


class Progress:
    """Feed it decode's chunks in order; it returns what the client gets and remembers what went."""

    __slots__ = ("_id_slices", "_is_plain", "_pending", "_prompt_slice", "_show_ids", "first", "kept",
                 "last_tokens")  # fmt: skip

    def __init__(self, show_ids: bool, keep_chunks: bool) -> None:
        self._show_ids = show_ids  # the client asked for token ids itself: pass them on
        # each event's ids as decode sent them: digits and commas, maybe followed by "]" and the event's end
        self._id_slices: list[bytes] = []
        self._prompt_slice: bytes | None = None
        self._pending = b""  # an event not yet ended by its blank line
        self.first: bytes | None = None  # the first chunk the client got: the stream's template
        self.last_tokens: bytes | None = None  # the last chunk that carried token ids
        self.kept: list[bytes] | None = [] if keep_chunks else None  # every chunk the client got
        # The common case from the first token event on: nothing pending, nothing kept, prompt ids seen.
        self._is_plain = False

    def feed(self, chunk: bytes) -> bytes:
        """``chunk`` as the client gets it (b"" while an event is incomplete).

        The fast path is a chunk that begins at an event (nothing pending) and ends with the one token
        event in it, its ids last, as vLLM writes a token's event: one split at the key finds them (a
        second event with ids would make a third part), the tail after the key is kept as it is (its
        ids end at its first ``]``) and the client's bytes are the head and a constant. Every method
        call costs here: each is a sizeable share of what relaying the chunk costs."""
        parts = chunk.split(_IDS)
        if len(parts) != 2 or not self._is_plain or not (tail := parts[1]).endswith(_IDS_LAST):
            if len(parts) > 2 and self._is_plain and chunk.endswith(_END):
                return self._several(chunk, parts)
            return self._feed_any(chunk)
        self._id_slices.append(tail)
        if not self._show_ids:
            chunk = parts[0] + _NULL_LAST
        self.last_tokens = chunk
        return chunk

    def _several(self, chunk: bytes, parts: list[bytes]) -> bytes:
        """Several whole events, as a proxy reading slower than decode writes gets them (a whole short
        answer, often): each part after the first begins with its event's ids."""
        slices, rests = self._id_slices, [parts[0]]
        for part in parts[1:]:
            end = part.index(93)  # "]"
            slices.append(part[:end])
            rests.append(part[end + 1 :])
        if not self._show_ids:
            chunk = _NULL_IDS.join(rests)
        self.last_tokens = chunk
        return chunk

    def _feed_any(self, chunk: bytes) -> bytes:
        """Any chunk: an event cut by its edge, several events, the first ones (prompt ids), or a stream
        whose chunks are kept."""
        if self._pending:
            chunk, self._pending = self._pending + chunk, b""
        if not chunk.endswith(_END):
            cut = chunk.rfind(_END) + 2 if _END in chunk else 0
            chunk, self._pending = chunk[:cut], chunk[cut:]
            self._is_plain = False
            if not chunk:
                return b""
        if self._prompt_slice is None and (at := chunk.find(_PROMPT_IDS)) >= 0:
            chunk = self._cut_prompt(chunk, at)
        parts = _SPLIT_IDS(chunk)
        if len(parts) > 1:
            self._id_slices.extend(parts[1::2])
            chunk = chunk if self._show_ids else _NULL_IDS.join(parts[0::2])
            self.last_tokens = chunk
        self._is_plain = self.last_tokens is not None and not self._pending and self.kept is None
        if self.first is None:
            self.first = chunk
        if self.kept is not None:
            self.kept.append(chunk)
        return chunk

    def _cut_prompt(self, chunk: bytes, at: int) -> bytes:
        begin = at + len(_PROMPT_IDS)
        end = chunk.find(b"]", begin)
        self._prompt_slice = chunk[begin:end]
        return chunk if self._show_ids else chunk[: begin - 1] + b"null" + chunk[end + 1 :]

    # --- read only when a migration happens -------------------------------------------------------

    def add_ids(self, ids: list[int]) -> None:
        """Token ids a continuation sent the client (its events are parsed there anyway)."""
        if ids:
            self._id_slices.append(",".join(map(str, ids)).encode())

    def sent(self, event: bytes) -> None:
        """A token event a continuation sent the client, so that a later migration starts after it."""
        self.last_tokens = event
        if self.kept is not None:
            self.kept.append(event)

    @property
    def token_ids(self) -> list[int]:
        """Every token id the client has been sent, in order."""
        ids = (s.split(b"]", 1)[0] for s in self._id_slices)
        joined = b",".join(s for s in ids if s)
        return [int(t) for t in joined.split(b",")] if joined else []

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids as decode saw them (None: it never said)."""
        if self._prompt_slice is None:
            return None
        return [int(t) for t in self._prompt_slice.split(b",")] if self._prompt_slice else []

    @property
    def shows_ids(self) -> bool:
        """The client asked for token ids itself (decode's body says so either way: the proxy asked)."""
        return self._show_ids

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)


def events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of SSE bytes, [DONE] and error events left out."""
    found = []
    for payload in sse.payloads(raw):
        if payload == sse.DONE_PAYLOAD or sse.error_of(payload) is not None:
            continue
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if isinstance(data, dict):
            found.append(data)
    return found


def first_choice(event: dict[str, Any]) -> dict[str, Any] | None:
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None
