"""What a stream that may migrate sends its client (progress.py): the bytes vLLM would send had the proxy
not asked for token ids, however the chunks are cut, and every id kept."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve import sse
from pdserve.proxy.request.progress import Progress


def completion_event(
    text: str, ids: list[int] | None, prompt: list[int] | None = None, finish: str | None = None
) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
              "prompt_token_ids": prompt, "token_ids": ids}  # fmt: skip
    return sse.event(orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                   "choices": [choice]}))  # fmt: skip


def stream(asked: bool) -> list[bytes]:
    """A completions stream of five tokens, with ids (``asked``) or as vLLM sends it without."""
    events = [completion_event(' say "token_ids":[9]', [11] if asked else None, [1, 2, 3] if asked else None)]
    events += [completion_event(f" t{i}", [20 + i] if asked else None) for i in range(3)]
    events.append(completion_event(" end", [30] if asked else None, finish="length"))
    usage = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}  # fmt: skip
    return [*events, sse.event(orjson.dumps(usage)), sse.DONE]


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


@given(st.lists(st.integers(min_value=0, max_value=2000), max_size=12))
def test_however_the_chunks_are_cut_the_client_reads_what_vllm_sends_unasked_and_every_id_is_kept(
    points: list[int],
) -> None:
    progress = Progress(show_ids=False, keep_chunks=False)
    out = b"".join(progress.feed(c) for c in cut(b"".join(stream(asked=True)), points))
    assert out == b"".join(stream(asked=False))
    assert progress.token_ids == [11, 20, 21, 22, 30]
    assert progress.prompt_ids == [1, 2, 3]


def test_a_client_that_asked_for_ids_gets_the_bytes_untouched() -> None:
    progress = Progress(show_ids=True, keep_chunks=False)
    chunks = stream(asked=True)
    assert [progress.feed(c) for c in chunks] == chunks
    assert progress.token_ids == [11, 20, 21, 22, 30]


@pytest.mark.parametrize("keep", [False, True])
def test_the_last_token_event_and_the_first_are_kept_for_the_seam(keep: bool) -> None:
    progress = Progress(show_ids=False, keep_chunks=keep)
    sent = [progress.feed(c) for c in stream(asked=True)]
    assert progress.first == sent[0]
    assert progress.last_tokens == sent[4]  # the finish event: the answer was complete
    assert (progress.kept == sent) if keep else progress.kept is None


def test_a_chat_stream_gives_its_prompt_ids_on_the_role_event() -> None:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], "prompt_token_ids": [5, 6]}  # fmt: skip
    token = {**base, "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None,
                                  "token_ids": [42]}]}  # fmt: skip
    progress = Progress(show_ids=False, keep_chunks=False)
    out = progress.feed(sse.event(orjson.dumps(role)) + sse.event(orjson.dumps(token)))
    assert b"[5,6]" not in out and b"[42]" not in out and out.count(b"null") >= 2
    assert progress.prompt_ids == [5, 6] and progress.token_ids == [42]


@pytest.mark.parametrize("show", [False, True])
def test_several_whole_events_in_one_chunk_as_a_proxy_behind_decode_reads_them(show: bool) -> None:
    asked, unasked = stream(asked=True), stream(asked=False)
    progress = Progress(show_ids=show, keep_chunks=False)
    first = progress.feed(asked[0])
    rest = progress.feed(b"".join(asked[1:]))
    assert first + rest == b"".join(asked if show else unasked)
    assert progress.token_ids == [11, 20, 21, 22, 30]
