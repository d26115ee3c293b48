"""The NixlConnector protocol as plain data: request rewrites, params, error bodies. No sockets."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdserve import protocol, sse
from pdserve.errors import BadRequest
from pdserve.protocol import PREFILL_KV_PARAMS, REQUIRED_DECODE_KEYS

PREFILL_ANSWER_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2], [3]],
    "remote_engine_id": "engine-0",
    "remote_request_id": "cmpl-abc-0-1234abcd",
    "remote_host": "10.0.0.5",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 20,
    "remote_blocks_expiry_time": 1234.5,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}
CLIENT: dict[str, Any] = {
    "model": "m",
    "prompt": "Hello",
    "max_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 4,
    "n": 1,
    "logprobs": 3,
    "stop": ["\n"],
    "temperature": 0.3,
    "seed": 9,
}


def prefill_answer(params: Any) -> bytes:
    return orjson.dumps({"id": "cmpl-abc", "choices": [{"text": "x"}], "kv_transfer_params": params})


# --- Parsing and stripping ---------------------------------------------------------------------------


def test_parse_body_accepts_a_json_object() -> None:
    assert protocol.parse_body(b'{"prompt": "hi"}') == {"prompt": "hi"}


@pytest.mark.parametrize("raw", [b"{nope", b"", b"[1]", b'"text"', b"null"])
def test_parse_body_rejects_what_is_not_a_json_object(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        protocol.parse_body(raw)


def test_client_kv_transfer_params_are_stripped() -> None:
    body = {**CLIENT, "kv_transfer_params": {"remote_host": "evil.example"}}
    assert protocol.client_body(body) == CLIENT
    assert "kv_transfer_params" in body  # the caller's dict is left alone


def test_body_without_kv_transfer_params_passes_unchanged() -> None:
    assert protocol.client_body(CLIENT) == CLIENT


# --- Prefill rewrite ---------------------------------------------------------------------------------


def test_prefill_asks_for_one_unstreamed_token_and_remote_decode() -> None:
    body = protocol.prefill_body(CLIENT)
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    # Spelled out here, not read from PREFILL_KV_PARAMS: vLLM's NixlConnector wants exactly these.
    unknown_yet = dict.fromkeys(("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))
    assert body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, **unknown_yet}


def test_prefill_drops_fields_that_only_decode_may_see() -> None:
    body = protocol.prefill_body(CLIENT)
    assert "stream_options" not in body
    assert "min_tokens" not in body


def test_prefill_keeps_every_other_field() -> None:
    body = protocol.prefill_body(CLIENT)
    rewritten = {"max_tokens", "stream", "kv_transfer_params", "stream_options", "min_tokens"}
    assert {k: v for k, v in body.items() if k not in rewritten} == {
        k: v for k, v in CLIENT.items() if k not in rewritten
    }


def test_prefill_sets_max_completion_tokens_only_when_present() -> None:
    assert "max_completion_tokens" not in protocol.prefill_body(CLIENT)
    with_it = protocol.prefill_body({**CLIENT, "max_completion_tokens": 50})
    assert with_it["max_completion_tokens"] == 1
    assert with_it["max_tokens"] == 1


def test_prefill_adds_max_tokens_when_the_client_gave_none() -> None:
    body = protocol.prefill_body({"model": "m", "messages": []})
    assert body["max_tokens"] == 1


def test_prefill_rewrite_leaves_the_client_body_alone() -> None:
    before = orjson.dumps(CLIENT)
    protocol.prefill_body(CLIENT)
    assert orjson.dumps(CLIENT) == before


def test_each_prefill_body_gets_its_own_kv_params() -> None:
    first = protocol.prefill_body(CLIENT)
    first["kv_transfer_params"]["remote_host"] = "changed"
    assert protocol.prefill_body(CLIENT)["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert PREFILL_KV_PARAMS["remote_host"] is None


# --- Decode rewrite ----------------------------------------------------------------------------------


def test_decode_gets_the_clients_own_values() -> None:
    body = protocol.decode_body(CLIENT, PREFILL_ANSWER_PARAMS)
    assert {k: v for k, v in body.items() if k != "kv_transfer_params"} == CLIENT


def test_decode_gets_prefills_params_verbatim_but_for_its_cached_token_count() -> None:
    body = protocol.decode_body(CLIENT, PREFILL_ANSWER_PARAMS)
    expected = {k: v for k, v in PREFILL_ANSWER_PARAMS.items() if k != "remote_prefill_cached_tokens"}
    assert body["kv_transfer_params"] == expected


def test_decode_is_not_handed_prefills_cached_token_count() -> None:
    # vLLM's decode would report prefill's cache hits as its own cached_tokens: the proof would be blind.
    params = {**PREFILL_ANSWER_PARAMS, "remote_prefill_cached_tokens": 256}
    body = protocol.decode_body(CLIENT, params)
    assert "remote_prefill_cached_tokens" not in body["kv_transfer_params"]
    assert params["remote_prefill_cached_tokens"] == 256  # the caller's dict is left alone


def test_decode_after_prefill_rewrite_still_has_the_clients_values() -> None:
    protocol.prefill_body(CLIENT)
    body = protocol.decode_body(CLIENT, PREFILL_ANSWER_PARAMS)
    assert (body["max_tokens"], body["stream"], body["min_tokens"]) == (16, True, 4)
    assert body["stream_options"] == {"include_usage": True}


# --- When a request cannot be split ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "one prompt"},
        {"prompt": ["one prompt"]},
        {"prompt": [1, 2, 3, 4]},
        {"prompt": [[1, 2, 3]]},
        {"messages": [{"role": "user", "content": "hi"}], "n": 1},
        {"prompt": "x", "n": True},  # a bool is not a count
    ],
    ids=["text", "list-of-one", "token-ids", "list-of-one-token-list", "chat-n=1", "n=True"],
)
def test_single_prompts_can_be_split(body: dict[str, Any]) -> None:
    assert protocol.needs_local_prefill(body) is None


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": ["a", "b"]}, "batched prompts"),
        ({"prompt": [[1, 2], [3, 4]]}, "batched prompts"),
        ({"prompt": "a", "n": 2}, "n > 1"),
        ({"messages": [], "n": 3}, "n > 1"),
        ({"prompt": "a", "best_of": 2}, "best_of > 1"),
    ],
    ids=["text-batch", "token-id-batch", "n=2", "chat-n=3", "best_of=2"],
)
def test_batches_and_several_sequences_are_not_split(body: dict[str, Any], reason: str) -> None:
    assert protocol.needs_local_prefill(body) == reason


# --- Reading prefill's answer ------------------------------------------------------------------------


def test_kv_params_are_read_from_prefills_answer() -> None:
    assert protocol.kv_params_from_prefill(prefill_answer(PREFILL_ANSWER_PARAMS)) == PREFILL_ANSWER_PARAMS


def test_prefill_answer_that_is_not_json_is_an_error() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        protocol.kv_params_from_prefill(b"<html>502</html>")


@pytest.mark.parametrize("payload", [prefill_answer(None), b'{"id": "x"}', b"[1, 2]", prefill_answer("text")])
def test_prefill_answer_without_params_points_at_the_connector_config(payload: bytes) -> None:
    with pytest.raises(ValueError, match=r"no kv_transfer_params.*kv-transfer-config"):
        protocol.kv_params_from_prefill(payload)


@pytest.mark.parametrize("key", REQUIRED_DECODE_KEYS)
def test_prefill_params_missing_a_required_key_name_it(key: str) -> None:
    params = {k: v for k, v in PREFILL_ANSWER_PARAMS.items() if k != key}
    with pytest.raises(ValueError, match=f"lacks {key}"):
        protocol.kv_params_from_prefill(prefill_answer(params))


def test_prefill_params_with_null_required_keys_name_them_all() -> None:
    params = {**PREFILL_ANSWER_PARAMS, "remote_host": None, "tp_size": None}
    with pytest.raises(ValueError, match="lacks remote_host, tp_size"):
        protocol.kv_params_from_prefill(prefill_answer(params))


# --- Decode's answer ---------------------------------------------------------------------------------


def test_decode_answer_loses_its_null_kv_transfer_params() -> None:
    answer = {"id": "cmpl-1", "choices": [{"text": " hi"}], "kv_transfer_params": None}
    assert orjson.loads(protocol.without_transfer_metadata(orjson.dumps(answer))) == {
        "id": "cmpl-1",
        "choices": [{"text": " hi"}],
    }


@pytest.mark.parametrize(
    "payload", [b'{"id": "cmpl-1"}', b'not json "kv_transfer_params"', b'["kv_transfer_params"]']
)
def test_answers_without_the_key_or_not_objects_pass_untouched(payload: bytes) -> None:
    assert protocol.without_transfer_metadata(payload) == payload


# --- Errors and SSE ----------------------------------------------------------------------------------


def test_error_body_has_vllms_shape() -> None:
    body = orjson.loads(
        protocol.error_body("max_tokens must be at least 1", "BadRequestError", 400, "max_tokens")
    )
    assert body == {
        "error": {
            "message": "max_tokens must be at least 1",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }


def test_error_body_param_defaults_to_null() -> None:
    assert orjson.loads(protocol.error_body("gone", "upstream_timeout", 504))["error"]["param"] is None


def test_request_ids_are_unique_hex() -> None:
    ids = {protocol.new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_streamed_error_events_learn_where_they_came_from_and_nothing_else_changes() -> None:
    token = b'data: {"choices":[{"text":" hi"}]}\n\n'
    error = b'data: {"error": {"message": "Internal server error", "type": "InternalServerError"}}\n\n'
    cut = b'data: {"error": {"mess'  # an event cut by the chunk's edge is left alone
    out = protocol.with_error_event_origin(token + error + sse.DONE + cut, "decode instance http://d:1")
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == token
    assert orjson.loads(events[1][len(b"data: ") :])["error"]["message"] == (
        "decode instance http://d:1: Internal server error"
    )
    assert events[2] + b"\n\n" == sse.DONE and events[3] == cut


def test_a_lease_redo_gets_a_salt_vllm_accepts_that_no_earlier_request_had() -> None:
    body = {"prompt": "hi", "cache_salt": "tenant-a"}
    redo = protocol.with_fresh_cache_salt(body, "lease-retry-0123456789abcdef")
    salt = redo["cache_salt"]
    assert salt != "tenant-a" and body["cache_salt"] == "tenant-a"  # the client's body is left alone
    # vLLM's own rule (validate_cache_salt): a non-empty string of at most 128 characters without / @ \ NUL
    assert 0 < len(salt) <= 128 and not set(salt) & set("/@\\\0")
    assert redo["prompt"] == "hi"


def test_a_clients_cache_salt_reaches_both_legs_so_their_block_hashes_agree() -> None:
    # A proof's probe relies on it: decode holds no prefix under the salt, and prefill's blocks are the
    # prompt's under the same salt.
    body = {"prompt": "hi", "cache_salt": "pdserve-verify-0123"}
    params = {"remote_block_ids": [[1]], "remote_engine_id": "e", "remote_prefill_cached_tokens": 0}
    assert protocol.prefill_body(body)["cache_salt"] == "pdserve-verify-0123"
    assert protocol.decode_body(body, params)["cache_salt"] == "pdserve-verify-0123"
