"""SSE as vLLM writes it: event payloads for clients, error/[DONE] markers for the relay."""

from __future__ import annotations

import pytest

from pdserve import sse
from pdserve.protocol import error_body

TOKEN = b'data: {"choices":[{"text":" hi"}]}\n\n'
ERROR = sse.event(error_body("failed", "InternalServerError", 500))


def test_error_event_is_recognised_by_its_marker() -> None:
    # Markers carry the blank line that ends the previous event (the stream's start counts as one).
    assert sse.ERROR_MARK in b"\n\n" + ERROR
    assert ERROR.endswith(b"\n\n")
    assert sse.DONE_MARK in b"\n\n" + sse.DONE


def test_payloads_of_a_whole_body_in_order_with_done_last() -> None:
    assert sse.payloads(TOKEN + ERROR + sse.DONE) == [
        b'{"choices":[{"text":" hi"}]}',
        error_body("failed", "InternalServerError", 500),
        b"[DONE]",
    ]


def test_reader_joins_events_split_anywhere_across_chunks() -> None:
    raw = TOKEN * 3 + sse.DONE
    for cut in range(1, len(raw)):
        reader = sse.EventReader()
        found = [*reader.feed(raw[:cut]), *reader.feed(raw[cut:])]
        assert found[-1] == sse.DONE_PAYLOAD and len(found) == 4, cut


def test_reader_keeps_a_cut_event_pending_instead_of_inventing_it() -> None:
    reader = sse.EventReader()
    assert list(reader.feed(TOKEN + b'data: {"choi')) == [b'{"choices":[{"text":" hi"}]}']
    assert reader.pending == b'data: {"choi'


def test_crlf_framing_and_comments_are_understood() -> None:
    assert sse.payloads(b': keep-alive\r\n\r\ndata: {"a":1}\r\n\r\n') == [b'{"a":1}']


def test_error_of_reads_only_error_events() -> None:
    assert sse.error_of(error_body("boom", "InternalServerError", 500)) == {
        "message": "boom", "type": "InternalServerError", "param": None, "code": 500,
    }  # fmt: skip
    assert sse.error_of(b'{"choices":[]}') is None
    assert sse.error_of(b"[DONE]") is None


@pytest.mark.parametrize("cut", range(1, len(ERROR)))
def test_watch_sees_an_error_event_however_the_chunks_fall(cut: int) -> None:
    watch = sse.StreamWatch()
    stream = TOKEN + ERROR
    edge = len(TOKEN) + cut
    seen = [watch.feed(stream[:edge]), watch.feed(stream[edge:])]
    assert any(seen)


def test_watch_sees_the_error_event_exactly_once_and_done_however_three_chunks_fall() -> None:
    # Whole events take a shortcut (no marker search) only where the last chunk ended one: every way of
    # cutting the stream in three, blank lines split included, must see what one chunk sees.
    stream = TOKEN + b"\n" + TOKEN + ERROR + sse.DONE
    for first in range(len(stream) + 1):
        for second in range(first, len(stream) + 1, 3):
            watch = sse.StreamWatch()
            seen = [watch.feed(c) for c in (stream[:first], stream[first:second], stream[second:])]
            assert sum(seen) == 1 and watch.has_done, (first, second, seen)
    watch = sse.StreamWatch()
    assert [watch.feed(TOKEN), watch.feed(TOKEN), watch.feed(sse.DONE)] == [False, False, False]
    assert watch.has_done


def test_watch_sees_an_error_event_once_and_done_when_it_comes() -> None:
    watch = sse.StreamWatch()
    assert watch.feed(ERROR) is True
    assert watch.feed(TOKEN) is False  # the error event was in the last chunk, not this one
    assert not watch.has_done
    watch.feed(sse.DONE[:5])
    watch.feed(sse.DONE[5:])
    assert watch.has_done


def test_a_token_whose_text_spells_a_marker_is_not_one() -> None:
    watch = sse.StreamWatch()
    fake = b'data: {"choices":[{"text":"data: {\\"error\\" data: [DONE]"}]}\n\n'
    assert watch.feed(fake) is False
    assert not watch.has_done


def test_rewriting_error_events_touches_only_complete_error_payloads() -> None:
    chunk = TOKEN + ERROR + sse.DONE + ERROR[:10]  # the last error event is cut by the chunk's edge
    out = sse.rewrite_error_events(chunk, lambda payload: b'{"error": "rewritten"}')
    assert out == TOKEN + sse.event(b'{"error": "rewritten"}') + sse.DONE + ERROR[:10]
    assert sse.rewrite_error_events(TOKEN + sse.DONE, lambda payload: b"never") == TOKEN + sse.DONE
