"""What decode alone would refuse is refused before prefill runs (proxy/request/validation.py), in vLLM's words;
and, over any JSON body, the proxy either refuses it cleanly before calling an instance or sends prefill
and decode the client's body with only the documented fields changed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memory_upstream import Recorder
from test_flow_memory import PARAMS, System, decode_text, prefill_ok

from pdserve.protocol import PREFILL_KV_PARAMS, Endpoint
from pdserve.proxy.record.responder import Responder

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hello"}


async def ask(system: System, endpoint: Endpoint, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    send = Recorder()
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    await system.flow.serve(endpoint, raw, None, Responder(send, "r"))
    return send.status, orjson.loads(send.body) if send.body.startswith(b"{") else {}


def system() -> System:
    return System([prefill_ok], [decode_text("ok")])


def num_calls(s: System) -> int:
    return sum(len(u.calls) for u in s.upstreams.values())


# (endpoint, fields, param, the start of vLLM 0.32's message): each one a request that prefill, seeing
# max_tokens=1, no stream and no min_tokens/stream_options, would take, and decode would refuse.
REFUSED = [
    ("completions", {"max_tokens": "abc"}, "body.max_tokens", "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'abc'"),
    ("completions", {"max_tokens": -1}, "max_tokens", "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)"),
    ("completions", {"max_tokens": 0, "stream": True}, "max_tokens", "max_tokens must be at least 1, got 0."),
    ("completions", {"max_tokens": 1.5}, "body.max_tokens", "1 validation error:\n  {'type': 'int_from_float'"),
    ("completions", {"max_tokens": -1, "stream": True}, "max_tokens", "max_tokens must be at least 1, got -1."),
    ("chat", {"max_tokens": -1}, "max_tokens", "max_tokens must be at least 1, got -1."),
    ("chat", {"max_completion_tokens": 0, "max_tokens": 5}, "max_tokens", "max_tokens must be at least 1, got 0."),
    ("chat", {"max_tokens": "abc", "stream": True}, "body.max_tokens", "1 validation error:"),
    ("completions", {"min_tokens": 5, "max_tokens": 2}, None, "min_tokens must be less than or equal to max_tokens=2, got 5."),
    ("completions", {"min_tokens": 17}, None, "min_tokens must be less than or equal to max_tokens=16, got 17."),
    ("completions", {"min_tokens": -1}, None, "min_tokens must be greater than or equal to 0, got -1."),
    ("completions", {"min_tokens": None}, "body.min_tokens", "1 validation error:\n  {'type': 'int_type'"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options", "Stream options can only be defined when `stream=True`."),
    ("completions", {"stream_options": {"include_usage": True}, "stream": False}, "stream_options", "Stream options"),
    ("completions", {"stream": "maybe"}, "body.stream", "1 validation error:\n  {'type': 'bool_parsing'"),
    ("completions", {"stream": True, "stream_options": {"include_usage": 3}}, "body.stream_options.include_usage", "1 validation error:"),
    ("completions", {"max_tokens": [1], "stream": 2}, "body.max_tokens", "2 validation errors:"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "fields", "param", "message"), REFUSED)
async def test_what_only_decode_would_refuse_is_refused_before_prefill(
    endpoint: Endpoint, fields: dict[str, Any], param: str | None, message: str
) -> None:
    s = system()
    status, body = await ask(s, endpoint, {**(CHAT if endpoint == "chat" else COMPLETION), **fields})
    assert status == 400
    assert body["error"]["message"].startswith(message)
    assert body["error"]["param"] == param
    assert num_calls(s) == 0


# What vLLM 0.32 takes (pydantic's lax coercion), and so must the proxy.
TAKEN = [
    {"max_tokens": "5"}, {"max_tokens": " 5 "}, {"max_tokens": "5.0"}, {"max_tokens": 2.0},
    {"max_tokens": True}, {"max_tokens": None}, {"min_tokens": "2", "max_tokens": 4},
    {"stream": "yes"}, {"stream": 0}, {"stream": None}, {"stream_options": {}},
    {"stream_options": {"include_usage": True}, "stream": True}, {"min_tokens": 16},
]  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("completions", {"max_tokens": 2049}, "max_tokens=2049 cannot be greater than max_model_len=2048. Please request fewer output tokens. (parameter=max_tokens, value=2049)"),
        ("chat", {"max_completion_tokens": 4000, "max_tokens": 5}, "max_completion_tokens=4000 cannot be greater than max_model_len=2048. Please request fewer output tokens. (parameter=max_completion_tokens, value=4000)"),
    ],
)  # fmt: skip
async def test_max_tokens_beyond_decodes_context_is_refused_once_the_proxy_knows_it(
    endpoint: Endpoint, fields: dict[str, Any], message: str
) -> None:
    s = system()
    body = {**(CHAT if endpoint == "chat" else COMPLETION), **fields}
    await ask(s, endpoint, body)
    assert num_calls(s) == 2, "refused before the proxy knew decode's context length"
    s = system()
    s.flow.max_model_len = 2048
    status, answer = await ask(s, endpoint, body)
    assert (status, answer["error"]["message"]) == (400, message)
    assert num_calls(s) == 0


@pytest.mark.parametrize("fields", TAKEN)
async def test_what_vllm_takes_goes_on_to_prefill(fields: dict[str, Any]) -> None:
    s = system()
    await ask(s, "completions", {**COMPLETION, **fields})
    assert s.calls("http://p0:1"), f"{fields} was refused, but vLLM takes it"


# --- any JSON body ------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
FIELDS = st.sampled_from(
    ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
     "stream_options", "kv_transfer_params", "n", "temperature", "cache_salt", "echo", "logprobs", "x"]
)  # fmt: skip
INTERESTING = st.one_of(
    JSON,
    st.sampled_from([1, 2, 16, "4", "x", True, False, -1, 0, 1.5, {"include_usage": True}, {}, "true"]),
)
BODIES = st.dictionaries(FIELDS, INTERESTING, max_size=7) | JSON

# The fields the proxy changes, per leg; every other field goes as the client sent it.
PREFILL_CHANGES = {"max_tokens", "max_completion_tokens", "stream", "kv_transfer_params", "min_tokens",
                   "stream_options", "return_token_ids"}  # fmt: skip


def _without_ids_asked(decoded: dict[str, Any], client: dict[str, Any]) -> dict[str, Any]:
    """Decode's body less the ``return_token_ids`` the proxy adds to a stream that may migrate."""
    if "return_token_ids" in client or "return_token_ids" not in decoded:
        return decoded
    assert client.get("stream") is True and decoded["return_token_ids"] is True
    return {k: v for k, v in decoded.items() if k != "return_token_ids"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES, endpoint=st.sampled_from(["completions", "chat"]))
async def test_any_body_is_refused_cleanly_before_any_call_or_passed_on_with_only_documented_changes(
    body: Any, endpoint: Endpoint
) -> None:
    s = system()
    status, answer = await ask(s, endpoint, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS))
    if status != 200:
        assert 400 <= status < 500, answer
        assert isinstance(answer["error"]["message"], str) and answer["error"]["code"] == status
        assert num_calls(s) == 0
        return
    client = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    prefill_calls, decode_calls = s.calls("http://p0:1"), s.calls("http://d0:1")
    assert len(decode_calls) == 1
    if prefill_calls:
        [to_prefill] = prefill_calls
        assert {k: v for k, v in to_prefill.items() if k not in PREFILL_CHANGES} == {
            k: v for k, v in client.items() if k not in PREFILL_CHANGES
        }
        assert (to_prefill["max_tokens"], to_prefill["stream"]) == (1, False)
        assert to_prefill["kv_transfer_params"] == PREFILL_KV_PARAMS
        assert "min_tokens" not in to_prefill and "stream_options" not in to_prefill
        assert _without_ids_asked(decode_calls[0], client) == {**client, "kv_transfer_params": PARAMS}
    else:
        assert (
            _without_ids_asked(decode_calls[0], client) == client
        )  # served whole by decode (batch, n > 1, prompt logprobs)
