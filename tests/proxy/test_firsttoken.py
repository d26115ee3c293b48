"""The first token at once: which requests may get it, the events that carry it, and decode's stream
less that token (firsttoken.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdserve import sse
from pdserve.proxy.request.firsttoken import FirstTokenCut, FirstTokenMismatch, early_token, may_send_early


def _answer(text: str, finish: str = "length", chat: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"id": "cmpl-r1", "created": 7, "model": "m", "choices": [choice]}


def _event(text: str | None, chat: bool = False, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": None, **extra}
    choice |= {"delta": {} if text is None else {"content": text}} if chat else {"text": text}
    return sse.event(orjson.dumps({"id": "cmpl-r1", "choices": [choice]}))


def _texts(raw: bytes, chat: bool = False) -> list[str]:
    out = []
    for payload in sse.payloads(raw):
        if payload == sse.DONE_PAYLOAD:
            continue
        choice = orjson.loads(payload)["choices"][0]
        out.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return out


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.8, "seed": 3}, True),
        ({"temperature": 0.8}, False),  # random: decode would draw its own first token
        ({}, False),  # vLLM's default temperature is 1
        ({"temperature": 0, "logprobs": 2}, False),
        ({"temperature": 0, "stop": ["x"]}, False),  # vLLM holds back text that may begin a stop string
        ({"temperature": 0, "n": 2}, False),
    ],
)
def test_only_streams_whose_first_token_decode_draws_again_get_it_at_once(
    body: dict[str, Any], expected: bool
) -> None:
    assert may_send_early(body, is_stream=True) is expected
    assert may_send_early(body, is_stream=False) is False


def test_prefills_token_becomes_the_streams_first_event_under_prefills_answer_id() -> None:
    early = early_token("completions", _answer("Hello"))
    assert early is not None and early.text == "Hello"
    [event] = [orjson.loads(p) for p in sse.payloads(early.events)]
    assert event["id"] == "cmpl-r1" and event["object"] == "text_completion"
    assert event["choices"][0]["text"] == "Hello" and event["choices"][0]["finish_reason"] is None


def test_a_chat_stream_begins_with_the_role_then_prefills_token() -> None:
    early = early_token("chat", _answer("Hi", chat=True))
    assert early is not None
    events = [orjson.loads(p) for p in sse.payloads(early.events)]
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}


@pytest.mark.parametrize("answer", [_answer("x", finish="stop"), _answer(""), _answer("\ufffd"), {}])
def test_a_token_that_ended_prefills_answer_or_prints_nothing_waits_for_decode(
    answer: dict[str, Any],
) -> None:
    assert early_token("completions", answer) is None


def test_decodes_stream_goes_on_after_the_token_the_client_has() -> None:
    cut = FirstTokenCut("completions", "Hello")
    stream = _event("Hello", token_ids=[5]) + _event(" world") + sse.DONE
    # cut at an awkward place: the first event arrives in two chunks
    out = cut.feed(stream[:10]) + cut.feed(stream[10:])
    assert _texts(out) == ["", " world"]
    first = orjson.loads(sse.payloads(out)[0])["choices"][0]
    assert first["token_ids"] == [5]  # the event stays: its ids still count for a migration
    assert out.endswith(sse.DONE)


def test_tokens_vllm_merged_into_one_event_keep_all_but_prefills() -> None:
    cut = FirstTokenCut("chat", "med")
    out = cut.feed(_event(None, chat=True) + _event("medieve", chat=True) + _event("d", chat=True))
    assert _texts(out, chat=True) == ["ieve", "d"]  # chat's role event is dropped: the client had prefill's


def test_a_different_first_token_ends_the_stream_rather_than_mixing_two_answers() -> None:
    cut = FirstTokenCut("completions", "Hello")
    with pytest.raises(FirstTokenMismatch, match="not prefill's"):
        cut.feed(_event("Howdy"))


def test_an_error_event_before_the_token_passes_to_the_relay() -> None:
    cut = FirstTokenCut("completions", "Hello")
    error = sse.event(b'{"error": {"message": "KV load failed"}}')
    assert cut.feed(error) == error


def test_prefills_ids_ride_in_the_early_events_where_vllm_streams_them() -> None:
    completions = _answer("Hi")
    completions["choices"][0] |= {"prompt_token_ids": [1, 2, 3], "token_ids": [9]}
    early = early_token("completions", completions, with_ids=True)
    assert early is not None and early.has_ids
    [event] = [orjson.loads(p) for p in sse.payloads(early.events)]
    assert event["choices"][0]["prompt_token_ids"] == [1, 2, 3] and event["choices"][0]["token_ids"] == [9]
    chat = _answer("Hi", chat=True) | {"prompt_token_ids": [1, 2, 3]}
    chat["choices"][0]["token_ids"] = [9]
    early = early_token("chat", chat, with_ids=True)
    assert early is not None and early.has_ids
    role, token = (orjson.loads(p) for p in sse.payloads(early.events))
    assert role["prompt_token_ids"] == [1, 2, 3] and token["choices"][0]["token_ids"] == [9]
    # not asked for, or not in prefill's answer: the events are as before
    assert not early_token("completions", completions).has_ids  # type: ignore[union-attr]
    assert not early_token("completions", _answer("Hi"), with_ids=True).has_ids  # type: ignore[union-attr]


def test_with_ids_sent_early_decodes_first_event_loses_the_prompts_and_that_tokens() -> None:
    cut = FirstTokenCut("completions", "Hello", has_ids=True)
    out = cut.feed(
        _event("Hello world", token_ids=[5, 6], prompt_token_ids=[1, 2]) + _event("!", token_ids=[7])
    )
    first, second = (orjson.loads(p)["choices"][0] for p in sse.payloads(out))
    assert first["text"] == " world" and first["token_ids"] == [6] and first["prompt_token_ids"] is None
    assert second["token_ids"] == [7]  # past the first token nothing is touched
