"""Server-sent events as vLLM writes them: ``data: <json>\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` last,
and, when generation fails after the 200, ``data: {"error": {...}}`` before ``[DONE]``.

Two readers, one grammar:
- ``EventReader`` splits a byte stream into event payloads, for clients that look inside every event
  (verify, bench, calibrate).
- ``StreamWatch`` only watches relayed bytes for the error event and ``[DONE]``, for the proxy's hot path:
  it never splits or decodes a chunk. Its markers include the blank line that ends the previous event:
  JSON strings cannot hold a raw newline, so no token's text can fake one.

``rewrite_error_events`` is the relay's error path: only a chunk ``StreamWatch`` found an error in is split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

import orjson

DONE: Final = b"data: [DONE]\n\n"
DONE_PAYLOAD: Final = b"[DONE]"
ERROR_MARK: Final = b'\n\ndata: {"error"'
DONE_MARK: Final = b"\n\ndata: [DONE]"
_MARK_TAIL: Final = max(len(ERROR_MARK), len(DONE_MARK))
_DATA: Final = b"data:"
_EVENT_END: Final = b"\n\n"
_ERROR_EVENT: Final = ERROR_MARK.removeprefix(_EVENT_END)
_MARKED_EVENTS: Final = (_ERROR_EVENT, DONE_MARK.removeprefix(_EVENT_END))  # events a marker begins


def event(payload: bytes) -> bytes:
    """One SSE event carrying ``payload``."""
    return b"data: " + payload + b"\n\n"


def _payload(raw_event: bytes) -> bytes | None:
    """The data of one event; None for comments and events without data."""
    for line in raw_event.split(b"\n"):
        if line.startswith(_DATA):
            return line[len(_DATA) :].removeprefix(b" ").rstrip(b"\r")
    return None


class EventReader:
    """Feed it chunks as they arrive; it yields the payload of each complete event."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        *complete, self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
        for raw_event in complete:
            payload = _payload(raw_event)
            if payload is not None:
                yield payload

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet ended by its blank line (a stream cut mid-event leaves some)."""
        return self._buffer


def payloads(raw: bytes) -> list[bytes]:
    """Every event payload of a whole SSE body, in order."""
    reader = EventReader()
    found = list(reader.feed(raw))
    tail = _payload(reader.pending)
    return [*found, tail] if tail else found


def rewrite_error_events(chunk: bytes, rewrite: Callable[[bytes], bytes]) -> bytes:
    """``chunk`` with the payload of each complete error event replaced by ``rewrite(payload)``.

    Every other byte passes unchanged: token events, [DONE], and an event cut by the chunk's edge (its
    end, and so its whole payload, is not here yet).
    """
    *events, cut = chunk.split(_EVENT_END)
    rewritten = (
        event(rewrite(e[len(b"data: ") :])) if e.startswith(_ERROR_EVENT) else e + _EVENT_END for e in events
    )
    return b"".join(rewritten) + cut


def error_of(payload: bytes) -> dict[str, object] | None:
    """The ``error`` object of an error event's payload, or None for any other payload."""
    if not payload.startswith(b'{"error"'):
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return {"message": payload.decode("utf-8", "replace")}
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, dict) else {"message": str(error)}


class StreamWatch:
    """Watches relayed SSE bytes for vLLM's error event and for ``[DONE]``; markers may straddle chunks.

    The stream's start counts as an event boundary.
    """

    __slots__ = ("_tail", "has_done")

    def __init__(self) -> None:
        self._tail = _EVENT_END  # the stream's start is a boundary
        self.has_done = False

    def feed(self, chunk: bytes) -> bool:
        """Take the next chunk; True when an error event begins in it (or across its front edge)."""
        # The common chunk is one whole token event begun where the last chunk ended one. A JSON line
        # holds no raw newline, so its first newline is its end's: no marker is inside it, and one that
        # straddles the front edge would make it begin with its event. Two byte searches for markers
        # cost more than the rest of this chunk's relay; this costs a memchr and a prefix test.
        if (
            self._tail is _EVENT_END
            and chunk.find(10) == len(chunk) - 2
            and chunk[-1] == 10
            and not chunk.startswith(_MARKED_EVENTS)
        ):
            return False
        window = self._tail + chunk
        # A marker that straddles the edge has at most len - 1 bytes before it; keeping fewer than a
        # whole marker also means one seen in this chunk is not seen again in the next. A window that
        # ends an event keeps only the blank line: a marker can then only begin there.
        self._tail = _EVENT_END if window.endswith(_EVENT_END) else window[-(_MARK_TAIL - 1) :]
        if DONE_MARK in window:
            self.has_done = True
        return ERROR_MARK in window
