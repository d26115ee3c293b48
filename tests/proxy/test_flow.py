"""A request's path through the running proxy: what the client gets, and what prefill and decode were sent."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from fake_vllm import MODEL, FakeVLLM
from proxy_rig import STRICT, TIMEOUTS, Rig, running_proxy, serve_fake

from pdserve import protocol
from pdserve.protocol import PREFILL_KV_PARAMS

COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5}
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5}
EVIL_KV_PARAMS = {
    "do_remote_prefill": True,
    "remote_block_ids": [[7]],
    "remote_engine_id": "attacker",
    "remote_request_id": "cmpl-x-0-00000000",
    "remote_host": "evil.example",
    "remote_port": 1,
    "tp_size": 1,
}


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, request_id: str | None = None
) -> tuple[int, Mapping[str, str], bytes]:
    """POST ``body`` (bytes as they are, anything else as JSON); status, headers and the whole answer."""
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(url, data=data, headers=headers) as resp:
        return resp.status, resp.headers, await resp.read()


async def timed_post(
    http: aiohttp.ClientSession, url: str, body: Any, request_id: str | None = None
) -> tuple[int, bytes, float]:
    """``post``'s status and answer, and the seconds it took."""
    begun = time.monotonic()
    status, _, answer = await post(http, url, body, request_id)
    return status, answer, time.monotonic() - begun


async def answer_while_hung(
    rig: Rig, http: aiohttp.ClientSession, fake: FakeVLLM, body: Any, request_id: str
) -> tuple[int, bytes, float]:
    """What the client gets while ``fake`` never answers: status, answer, and the seconds it took."""
    fake.fault = "hang"
    return await timed_post(http, rig.url + "/v1/completions", body, request_id)


def sse_data(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [event.removeprefix(b"data: ") for event in raw.split(b"\n\n") if event]


async def waited(condition: Callable[..., bool], *args: Any) -> bool:
    """Run one of the fakes' blocking, bounded waits without stalling the test's event loop."""
    return bool(await asyncio.to_thread(condition, *args))


# --- Answers -------------------------------------------------------------------------------------


async def test_completion_answer_is_decodes(rig: Rig, client: openai.AsyncOpenAI) -> None:
    completion = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5)
    assert completion.choices[0].text == rig.decode.text(5)
    assert len(rig.prefill.generations()) == 1
    assert len(rig.decode.generations()) == 1


async def test_chat_answer_is_decodes(rig: Rig, client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    assert chat.choices[0].message.content == rig.decode.text(4)
    assert [r.path for r in rig.prefill.generations()] == ["/v1/chat/completions"]
    assert [r.path for r in rig.decode.generations()] == ["/v1/chat/completions"]


async def test_streamed_completion_is_decodes_stream(rig: Rig, client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, stream=True)
    assert "".join([chunk.choices[0].text async for chunk in stream]) == rig.decode.text(6)


async def test_streamed_chat_is_decodes_stream(rig: Rig, client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == rig.decode.text(3)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_stream_reaches_the_client_as_sse_ending_with_done(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, headers, raw = await post(http, rig.url + "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_data(raw)
    assert events[-1] == b"[DONE]"
    assert "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1]) == rig.decode.text(5)


async def test_stream_whose_done_arrives_in_pieces_ends_normally(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    rig.decode.fault = "trickle"
    body = {**COMPLETION, "stream": True}
    status, _, raw = await post(http, rig.url + "/v1/completions", body, request_id="trickled")
    assert status == 200
    events = sse_data(raw)
    assert events[-1] == b"[DONE]"
    assert b"error" not in raw
    async with http.get(rig.url + "/requests") as resp:
        [trace] = [t for t in (await resp.json())["requests"] if t["request_id"] == "trickled"]
    assert trace["error"] is None


async def test_answer_carries_no_kv_transfer_params(rig: Rig, http: aiohttp.ClientSession) -> None:
    status, _, raw = await post(http, rig.url + "/v1/completions", COMPLETION)
    assert status == 200
    answer = orjson.loads(raw)
    assert "kv_transfer_params" not in answer
    assert answer["choices"][0]["text"] == rig.decode.text(5)


async def test_concurrent_requests_each_get_their_own_answer(rig: Rig, http: aiohttp.ClientSession) -> None:
    async def one(i: int) -> None:
        request_id, stream = f"concurrent-{i}", i % 2 == 0
        body = {**COMPLETION, "stream": stream}
        status, headers, raw = await post(http, rig.url + "/v1/completions", body, request_id=request_id)
        assert (status, headers["X-Request-Id"]) == (200, request_id)
        answers = [orjson.loads(e) for e in sse_data(raw)[:-1]] if stream else [orjson.loads(raw)]
        assert {a["id"] for a in answers} == {f"cmpl-{request_id}"}

    await asyncio.gather(*(one(i) for i in range(16)))
    decode_seen = rig.decode.generations()
    assert len(decode_seen) == 16
    for seen in decode_seen:
        assert seen.body is not None
        remote_request_id = seen.body["kv_transfer_params"]["remote_request_id"]
        assert remote_request_id.startswith(f"cmpl-{seen.headers['x-request-id']}-0-")


# --- What prefill and decode were sent -------------------------------------------------------------

RICH_COMPLETION: dict[str, Any] = {
    **COMPLETION,
    "stream_options": {"include_usage": True},
    "min_tokens": 2,
    "temperature": 0.7,
    "top_p": 0.9,
    "seed": 1234,
    "stop": ["\n\n", "END"],
    "logprobs": 2,
    "n": 1,
    "presence_penalty": 0.5,
    "user": "someone",
}
RICH_CHAT: dict[str, Any] = {
    **CHAT,
    "max_completion_tokens": 7,
    "response_format": {"type": "json_object"},
    "logprobs": True,
    "top_logprobs": 2,
    "temperature": 0.0,
    "stop": "}",
    "seed": 7,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", RICH_COMPLETION), ("/v1/chat/completions", RICH_CHAT)],
    ids=["completions", "chat"],
)
async def test_prefill_gets_one_token_request_and_decode_gets_clients_own(
    rig: Rig, http: aiohttp.ClientSession, path: str, body: dict[str, Any], stream: bool
) -> None:
    client_body = {**body, "stream": stream}
    if not stream:  # vLLM refuses stream_options without stream
        client_body.pop("stream_options", None)
    status, _, _ = await post(http, rig.url + path, client_body)
    assert status == 200

    [prefill_seen] = rig.prefill.generations()
    expected_prefill = {k: v for k, v in client_body.items() if k not in ("stream_options", "min_tokens")}
    expected_prefill.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_KV_PARAMS)
    if "max_completion_tokens" in client_body:
        expected_prefill["max_completion_tokens"] = 1
    assert prefill_seen.body == expected_prefill

    [decode_seen] = rig.decode.generations()
    [issued] = rig.prefill.issued_kv_params
    # All of prefill's params but its cached-token count, which decode would report as its own.
    forwarded = {k: v for k, v in issued.items() if k != "remote_prefill_cached_tokens"}
    assert decode_seen.body == {**client_body, "kv_transfer_params": forwarded}


async def test_prefill_gets_no_max_completion_tokens_when_client_sent_none(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, _, _ = await post(http, rig.url + "/v1/chat/completions", CHAT)
    assert status == 200
    [prefill_seen] = rig.prefill.generations()
    assert prefill_seen.body is not None
    assert prefill_seen.body["max_tokens"] == 1
    assert "max_completion_tokens" not in prefill_seen.body


async def test_client_request_id_reaches_both_instances_and_comes_back(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, headers, _ = await post(http, rig.url + "/v1/completions", COMPLETION, request_id="client-id-1")
    assert status == 200
    assert headers["X-Request-Id"] == "client-id-1"
    seen = [*rig.prefill.generations(), *rig.decode.generations()]
    assert [r.headers["x-request-id"] for r in seen] == ["client-id-1", "client-id-1"]
    assert rig.prefill.issued_kv_params[0]["remote_request_id"].startswith("cmpl-client-id-1-0-")


async def test_request_without_id_gets_one_shared_by_both_instances(
    rig: Rig, client: openai.AsyncOpenAI
) -> None:
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
    request_id = raw.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    seen = [*rig.prefill.generations(), *rig.decode.generations()]
    assert [r.headers["x-request-id"] for r in seen] == [request_id, request_id]
    assert [r.headers["authorization"] for r in seen] == ["Bearer x", "Bearer x"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_client_kv_transfer_params_never_reach_an_instance(
    rig: Rig, http: aiohttp.ClientSession, stream: bool
) -> None:
    body = {**COMPLETION, "stream": stream, "kv_transfer_params": EVIL_KV_PARAMS}
    status, _, raw = await post(http, rig.url + "/v1/completions", body)
    assert status == 200
    [prefill_seen] = rig.prefill.generations()
    [decode_seen] = rig.decode.generations()
    assert prefill_seen.body is not None and decode_seen.body is not None
    assert prefill_seen.body["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert (
        decode_seen.body["kv_transfer_params"]
        == protocol.decode_body({}, rig.prefill.issued_kv_params[0])["kv_transfer_params"]
    )
    assert b"evil.example" not in raw


async def test_client_kv_transfer_params_never_reach_decode_when_serving_alone(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    body = {**COMPLETION, "n": 2, "kv_transfer_params": EVIL_KV_PARAMS}
    status, _, _ = await post(http, rig.url + "/v1/completions", body)
    assert status == 200
    [decode_seen] = rig.decode.generations()
    assert decode_seen.body == {**COMPLETION, "n": 2}


@pytest.mark.parametrize(
    ("path", "extra", "num_choices"),
    [
        ("/v1/completions", {"n": 2}, 2),
        ("/v1/completions", {"prompt": ["first prompt", "second prompt"]}, 2),
        ("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]]}, 2),
        ("/v1/chat/completions", {"n": 3}, 3),
    ],
    ids=["n=2", "batched-text", "batched-token-ids", "chat-n=3"],
)
async def test_requests_that_cannot_be_split_go_straight_to_decode(
    rig: Rig, http: aiohttp.ClientSession, path: str, extra: dict[str, Any], num_choices: int
) -> None:
    body = {**(CHAT if "chat" in path else COMPLETION), **extra}
    status, _, raw = await post(http, rig.url + path, body)
    assert status == 200
    assert len(orjson.loads(raw)["choices"]) == num_choices
    assert rig.prefill.generations() == []
    [decode_seen] = rig.decode.generations()
    assert decode_seen.body == body


async def test_single_token_id_prompt_is_split(rig: Rig, http: aiohttp.ClientSession) -> None:
    body = {**COMPLETION, "prompt": [101, 102, 103, 104]}
    status, _, _ = await post(http, rig.url + "/v1/completions", body)
    assert status == 200
    [prefill_seen] = rig.prefill.generations()
    assert prefill_seen.body is not None and prefill_seen.body["prompt"] == [101, 102, 103, 104]
    assert len(rig.decode.generations()) == 1


# --- Bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""], ids=["broken", "not-an-object", "empty"])
async def test_invalid_json_is_rejected_without_calling_any_instance(
    rig: Rig, http: aiohttp.ClientSession, raw: bytes
) -> None:
    status, headers, body = await post(http, rig.url + "/v1/completions", raw, request_id="bad-json")
    assert status == 400
    assert headers["X-Request-Id"] == "bad-json"
    error = orjson.loads(body)["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert error["message"]
    assert rig.prefill.generations() == []
    assert rig.decode.generations() == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_bad_max_tokens_gets_vllms_400_before_any_instance_is_called(
    rig: Rig, client: openai.AsyncOpenAI, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt="Hello", max_tokens=-1, stream=stream)
    assert caught.value.param == "max_tokens"
    assert "max_tokens must be at least 1, got -1" in caught.value.message
    # Prefill would have taken it (it only ever sees max_tokens=1) and pinned its KV for nothing.
    assert rig.prefill.generations() == []
    assert rig.decode.generations() == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_refusal_only_decode_sees_coming_releases_prefills_blocks(
    rig: Rig, client: openai.AsyncOpenAI, http: aiohttp.ClientSession, stream: bool
) -> None:
    """min_tokens beyond the context the prompt leaves: only an engine that counts the prompt's tokens
    refuses it, after prefill. Decode is then made to pull prefill's blocks (one token, answer dropped),
    which frees them on prefill at once instead of when the lease runs out."""
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=2048, stream=stream, extra_body={"min_tokens": 2048}
        )
    assert "min_tokens must be less than or equal to max_tokens=" in caught.value.message
    [issued] = rig.prefill.issued_kv_params
    for _ in range(100):
        if len(rig.decode.generations()) == 2:
            break
        await asyncio.sleep(0.02)
    refused, release = rig.decode.generations()
    assert refused.body is not None and refused.body["min_tokens"] == 2048
    assert release.body is not None and "min_tokens" not in release.body
    assert (release.body["max_tokens"], release.body["stream"]) == (1, False)
    assert release.body["kv_transfer_params"] == issued
    assert release.body["cache_salt"].startswith("pdserve-release-")  # what it pulls matches no one else
    async with http.get(rig.url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'pdserve_kv_released_after_refusal_total{result="ok"}' in metrics


async def test_unknown_model_is_rejected_by_prefill_and_decode_is_never_called(
    rig: Rig, client: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="no-such-model", prompt="Hello", max_tokens=5)
    assert "The model `no-such-model` does not exist" in caught.value.message
    assert len(rig.prefill.generations()) == 1
    assert rig.decode.generations() == []


# --- Prefill faults ---------------------------------------------------------------------------------


async def test_hung_prefill_answers_504_naming_prefill_within_its_timeout(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, body, elapsed = await answer_while_hung(rig, http, rig.prefill, COMPLETION, "hung-prefill")
    assert status == 504
    assert elapsed < TIMEOUTS.prefill + 2
    error = orjson.loads(body)["error"]
    assert error["code"] == 504
    assert "prefill" in error["message"]
    assert "prefill instance prefill-0" in error["message"] and rig.prefill_url not in error["message"]
    assert rig.decode.generations() == []
    # The proxy hung up on prefill, which makes vLLM abort the request and free its blocks.
    assert await waited(rig.prefill.wait_for_disconnect, "hung-prefill", 1.0)
    rig.prefill.fault = None
    status, _, _ = await post(http, rig.url + "/v1/completions", COMPLETION)
    assert status == 200  # the next request is served as usual


async def test_unreachable_prefill_answers_502_naming_prefill_at_once(
    rig: Rig, http: aiohttp.ClientSession, dead_url: str
) -> None:
    with running_proxy([dead_url], [rig.decode_url], retries=STRICT) as url:
        status, body, elapsed = await timed_post(http, url + "/v1/completions", COMPLETION)
    assert status == 502
    assert elapsed < TIMEOUTS.connect + 1
    error = orjson.loads(body)["error"]
    assert "prefill" in error["message"]
    assert "prefill-0" in error["message"] and dead_url not in error["message"]
    assert rig.decode.generations() == []


async def error_when_prefill_fails(rig: Rig, http: aiohttp.ClientSession, fault: str) -> tuple[int, Any]:
    """The status and error a completion gets while prefill has ``fault``; decode must never be called."""
    rig.prefill.fault = fault
    status, _, body = await post(http, rig.url + "/v1/completions", COMPLETION)
    assert rig.decode.generations() == []
    return status, orjson.loads(body)["error"]


async def test_prefill_without_kv_transfer_params_is_a_502_protocol_error(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, error = await error_when_prefill_fails(rig, http, "no_kv_params")
    assert status == 502
    assert error["type"] == "upstream_protocol_error"
    assert "prefill" in error["message"]
    assert "kv_transfer_params" in error["message"]


async def test_prefill_500_reaches_the_client_and_decode_is_never_called(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, error = await error_when_prefill_fails(rig, http, "fail")
    assert status == 500
    # vLLM's own message, prefixed with who failed: vLLM's 500 alone does not say which instance.
    assert error["message"] == "prefill instance prefill-0: Internal server error"


async def test_client_hanging_up_during_prefill_aborts_prefill(rig: Rig, http: aiohttp.ClientSession) -> None:
    rig.prefill.fault = "hang"
    request = asyncio.ensure_future(
        post(http, rig.url + "/v1/completions", COMPLETION, request_id="gone-in-prefill")
    )
    try:
        assert await waited(rig.prefill.wait_for_request, "gone-in-prefill", 2.0)
    finally:
        request.cancel()
    # Well before the proxy's own prefill timeout would close it.
    assert await waited(rig.prefill.wait_for_disconnect, "gone-in-prefill", 1.0)
    assert rig.decode.generations() == []


# --- Decode faults ----------------------------------------------------------------------------------


async def test_unreachable_decode_answers_502_naming_decode(
    rig: Rig, http: aiohttp.ClientSession, dead_url: str
) -> None:
    with running_proxy([rig.prefill_url], [dead_url], retries=STRICT) as url:
        status, _, body = await post(http, url + "/v1/completions", COMPLETION)
    assert status == 502
    message = orjson.loads(body)["error"]["message"]
    assert "decode" in message
    assert "decode-0" in message and dead_url not in message
    assert len(rig.prefill.issued_kv_params) == 1


async def test_decode_500_reaches_the_client(rig: Rig, http: aiohttp.ClientSession) -> None:
    rig.decode.fault = "fail"
    status, _, body = await post(http, rig.url + "/v1/completions", COMPLETION)
    assert status == 500
    error = orjson.loads(body)["error"]
    assert error["type"] == "InternalServerError"
    assert error["message"].startswith("decode instance decode-0: ")


async def test_hung_decode_answers_504_naming_decode_within_its_timeout(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, body, elapsed = await answer_while_hung(rig, http, rig.decode, COMPLETION, "hung-decode")
    assert status == 504
    assert elapsed < TIMEOUTS.decode + 2
    assert "decode-0" in orjson.loads(body)["error"]["message"]
    assert await waited(rig.decode.wait_for_disconnect, "hung-decode", 1.0)


async def test_decode_silent_before_first_token_answers_504(rig: Rig, http: aiohttp.ClientSession) -> None:
    body = {**COMPLETION, "stream": True}
    status, raw, elapsed = await answer_while_hung(rig, http, rig.decode, body, "no-first-token")
    assert status == 504
    assert elapsed < TIMEOUTS.first_token + 2
    message = orjson.loads(raw)["error"]["message"]
    assert "decode" in message
    assert "decode-0" in message and rig.decode_url not in message
    assert await waited(rig.decode.wait_for_disconnect, "no-first-token", 1.0)


async def test_decode_error_event_makes_the_client_raise(rig: Rig, client: openai.AsyncOpenAI) -> None:
    rig.decode.fault = "error_event"
    stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True)
    with pytest.raises(openai.APIError, match="KV transfer failed") as caught:
        async for _ in stream:
            pass
    # vLLM's own message, and which instance sent it.
    assert "decode instance decode-0: KV transfer failed" in str(caught.value)


async def test_decode_dropping_the_stream_makes_the_client_raise(
    rig: Rig, client: openai.AsyncOpenAI
) -> None:
    rig.decode.fault = "drop"
    stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True)
    texts = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert "".join(texts) == rig.decode.text(2)  # what decode sent before it went away
    assert "decode" in caught.value.message
    assert "decode-0" in caught.value.message


async def test_dropped_stream_ends_with_an_error_event_then_done(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    rig.decode.fault = "drop"
    status, _, raw = await post(http, rig.url + "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    *tokens, error, done = sse_data(raw)
    assert len(tokens) == 2
    assert orjson.loads(error)["error"]["code"] == 502
    assert done == b"[DONE]"
    rig.decode.fault = None
    status, _, raw = await post(http, rig.url + "/v1/completions", {**COMPLETION, "stream": True})
    assert (status, sse_data(raw)[-1]) == (200, b"[DONE]")  # the next request is served as usual


async def test_decode_stalling_mid_stream_makes_the_client_raise_within_idle_timeout(
    rig: Rig, client: openai.AsyncOpenAI
) -> None:
    rig.decode.fault = "stall"
    stream = await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, stream=True, extra_headers={"X-Request-Id": "stalled"}
    )
    begun = time.monotonic()
    with pytest.raises(openai.APIError) as caught:
        async for _ in stream:
            pass
    assert time.monotonic() - begun < TIMEOUTS.idle + 1.5
    assert "decode" in caught.value.message
    assert await waited(rig.decode.wait_for_disconnect, "stalled", 1.0)


async def test_client_hanging_up_mid_stream_cancels_decode(rig: Rig, http: aiohttp.ClientSession) -> None:
    rig.decode.fault = "endless"
    body = orjson.dumps({**COMPLETION, "stream": True})
    headers = {"Content-Type": "application/json", "X-Request-Id": "gone-mid-stream"}
    async with http.post(rig.url + "/v1/completions", data=body, headers=headers) as resp:
        assert resp.status == 200
        assert (await resp.content.readany()).startswith(b"data: ")
        resp.close()
    assert await waited(rig.decode.wait_for_disconnect, "gone-mid-stream", 1.0)


# --- Several instances -------------------------------------------------------------------------------


async def test_requests_alternate_between_instances_and_decode_pulls_from_the_right_prefill(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    prefill2, decode2 = FakeVLLM("prefill"), FakeVLLM("decode")
    with (
        serve_fake(prefill2) as prefill2_url,
        serve_fake(decode2) as decode2_url,
        running_proxy([rig.prefill_url, prefill2_url], [rig.decode_url, decode2_url]) as url,
    ):
        for i in range(4):
            status, _, _ = await post(http, url + "/v1/completions", COMPLETION, request_id=f"turn-{i}")
            assert status == 200
    prefills, decodes = (rig.prefill, prefill2), (rig.decode, decode2)
    assert [len(fake.generations()) for fake in (*prefills, *decodes)] == [2, 2, 2, 2]
    issued = {
        p["remote_request_id"]: protocol.decode_body({}, p)["kv_transfer_params"]
        for fake in prefills
        for p in fake.issued_kv_params
    }
    for seen in [*rig.decode.generations(), *decode2.generations()]:
        assert seen.body is not None
        params = seen.body["kv_transfer_params"]
        assert params["remote_request_id"].startswith(f"cmpl-{seen.headers['x-request-id']}-0-")
        assert issued[params["remote_request_id"]] == params
