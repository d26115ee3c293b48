from __future__ import annotations

from pdserve.verify import Report, _read_stream, cases


def test_stream_text_is_joined_from_deltas() -> None:
    raw = (
        'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
        'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
        'data: {"choices": [{"delta": {"content": "lo"}}]}\n\n'
        "data: [DONE]\n\n"
    )
    answer = _read_stream(200, raw.encode(), "rid")
    assert (answer.text, answer.error) == ("Hello", None)


def test_stream_error_event_fails_even_with_status_200() -> None:
    raw = 'data: {"choices": [{"text": "a"}]}\n\ndata: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    answer = _read_stream(200, raw.encode(), None)
    assert answer.error is not None and "boom" in answer.error


def test_stream_without_done_is_an_error_not_a_short_answer() -> None:
    answer = _read_stream(200, b'data: {"choices": [{"text": "a"}]}\n\n', None)
    assert answer.error == "stream ended without [DONE]"


def test_cases_cover_both_endpoints_streamed_and_not_with_unique_prompts() -> None:
    first, second = cases("m"), cases("m")
    assert {(path, body["stream"]) for _, path, body in first} == {
        ("/v1/completions", False),
        ("/v1/completions", True),
        ("/v1/chat/completions", False),
        ("/v1/chat/completions", True),
    }
    assert first[0][2]["prompt"] != second[0][2]["prompt"]


def test_report_fails_when_any_check_fails_and_when_empty() -> None:
    report = Report()
    assert not report.ok
    report.check(True, "a")
    assert report.ok
    report.check(False, "b")
    assert not report.ok
    assert report.lines() == ["  PASS  a", "  FAIL  b"]
