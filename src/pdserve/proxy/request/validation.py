"""What decode would refuse but prefill never sees, refused before prefill runs.

Prefill gets the client's body with ``max_tokens``/``max_completion_tokens`` set to 1, ``stream`` false,
and ``min_tokens``/``stream_options`` dropped (protocol.prefill_body). Every other field reaches prefill
as the client sent it, so prefill refuses what is wrong there itself, before it computes anything. What
the rewrite hides only decode would refuse, after prefill has computed the prompt and holds its KV for
a pull that never comes: those fields are checked here, once per request, with vLLM's own rules and
words (vLLM 0.32: pydantic's lax coercion of the request model, the "before" model validators of
``CompletionRequest``/``ChatCompletionRequest``, then ``SamplingParams._verify_args``). A value vLLM
would take is never refused here: where its rule is not modelled, the request goes on as before.

``max_tokens`` beyond the model's context (``max_model_len``, as decode's /v1/models tells it) is
refused too, once the proxy knows that length. What is not checked: ``min_tokens`` above the output
budget vLLM clamps ``max_tokens`` to (the context left after the prompt), which needs the prompt's
length; decode refuses it, and the plan then has prefill's blocks freed (release.py).
"""

from __future__ import annotations

import math
from typing import Any, Final

from pdserve.errors import BadRequest
from pdserve.protocol import Endpoint

# pydantic's lax booleans (strings compared lower-case)
_TRUE: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE: Final = frozenset({"0", "off", "f", "false", "n", "no"})
_NOT_AN_INT: Final = object()


class FieldErrors(BadRequest):
    """Fields of the wrong type: vLLM answers these as pydantic's errors, typed "Bad Request"."""

    error_type = "Bad Request"


class _ErrorList:
    """pydantic's errors as vLLM's handler words them: the count, then one line per error."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.param: str | None = None

    def add(self, kind: str, loc: tuple[str, ...], msg: str, value: object, ctx: str = "") -> None:
        where = ".".join(("body", *loc))
        self.param = self.param or where
        self.lines.append(
            f"{{'type': '{kind}', 'loc': '{where}', 'msg': '{msg}', 'input': {_shown(value)}{ctx}}}"
        )

    def raise_any(self) -> None:
        if self.lines:
            n = len(self.lines)
            head = f"{n} validation {'error' if n == 1 else 'errors'}:\n"
            raise FieldErrors(head + "\n".join(f"  {line}" for line in self.lines), self.param)


def _shown(value: object) -> str:
    """The ``input`` of an error as vLLM shows it: as text, cut at 200 characters, containers described."""
    if isinstance(value, (list, dict)):
        return repr(f"<{type(value).__name__} of {len(value)} items>")
    text = value if isinstance(value, str) else str(value)
    if len(text) > 200:
        text = text[:200] + "...[truncated]"
    return repr(text)


def _lax_int(value: object, loc: str, errors: _ErrorList) -> object:
    """``value`` as pydantic's lax ``int`` makes it, or ``_NOT_AN_INT`` with the error noted."""
    if isinstance(value, int):  # bool included: pydantic takes true as 1
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        kind, msg = "int_from_float", "Input should be a valid integer, got a number with a fractional part"
        if not math.isfinite(value):
            kind, msg = "finite_number", "Input should be a finite number"
        errors.add(kind, (loc,), msg, value)
        return _NOT_AN_INT
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if math.isfinite(number) and number.is_integer() and "_" not in text:
            return int(number)
        errors.add("int_parsing", (loc,), "Input should be a valid integer, unable to parse string as an integer", value)  # fmt: skip
        return _NOT_AN_INT
    errors.add("int_type", (loc,), "Input should be a valid integer", value)
    return _NOT_AN_INT


def _check_lax_bool(value: object, loc: tuple[str, ...], errors: _ErrorList) -> None:
    if value is None or isinstance(value, bool):
        return
    if (isinstance(value, int) and value in (0, 1)) or (
        isinstance(value, str) and value.lower() in _TRUE | _FALSE
    ):
        return
    if isinstance(value, (int, str)):
        errors.add("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value)
    elif isinstance(value, (list, dict)):
        errors.add("bool_type", loc, "Input should be a valid boolean", value)
    # floats and the rest: not modelled, decode decides


def _refusal(message: str, param: str | None = None, value: object = None) -> BadRequest:
    """A ``VLLMValidationError`` as vLLM words it: its parameter and value follow the message."""
    extras = [f"parameter={param}"] if param is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return BadRequest(f"{message} ({', '.join(extras)})" if extras else message, param)


def _is_plain(endpoint: Endpoint, body: dict[str, Any], max_model_len: int | None) -> bool:
    """The common request, which nothing below would coerce or refuse: decided in a few lookups."""
    max_tokens, stream, options = body.get("max_tokens"), body.get("stream"), body.get("stream_options")
    if type(max_tokens) is int:
        if max_tokens < 1 or (max_model_len is not None and max_tokens > max_model_len):
            return False
    elif max_tokens is not None:
        return False
    elif endpoint == "completions" and "max_tokens" not in body and (max_model_len or 16) < 16:
        return False  # the default of 16 beyond a tiny context
    return (
        (stream is None or type(stream) is bool)
        and "min_tokens" not in body
        and "max_completion_tokens" not in body
        and (
            options is None
            or (stream is True and type(options) is dict and all(type(v) is bool for v in options.values()))
        )
    )


def check_before_prefill(endpoint: Endpoint, body: dict[str, Any], max_model_len: int | None = None) -> None:
    """Raise ``BadRequest`` (vLLM's message and ``param``) for what decode would refuse in the fields
    prefill's rewrite changes or drops. Cheap: a few dict lookups for an ordinary request."""
    if _is_plain(endpoint, body, max_model_len):
        return
    # The model's "before" validator, on the raw values (Python truthiness, as vLLM tests them).
    if body.get("stream_options") and not body.get("stream"):
        raise _refusal("Stream options can only be defined when `stream=True`.", "stream_options")
    # pydantic's field errors, in the request models' field order (the same in both)
    errors = _ErrorList()
    limits: dict[str, object] = {}
    # a completions request has no max_completion_tokens: vLLM ignores the field there
    for name in ("max_tokens", "max_completion_tokens") if endpoint == "chat" else ("max_tokens",):
        if name in body:
            value = body[name]
            limits[name] = None if value is None else _lax_int(value, name, errors)
    if "stream" in body:
        _check_lax_bool(body["stream"], ("stream",), errors)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            msg = "Input should be a valid dictionary or instance of StreamOptions"
            ctx = ", 'ctx': {'class_name': 'StreamOptions'}"
            errors.add("model_type", ("stream_options",), msg, options, ctx)
        else:
            for key in ("include_usage", "continuous_usage_stats"):
                if key in options:
                    _check_lax_bool(options[key], ("stream_options", key), errors)
    if "min_tokens" in body:  # not nullable
        limits["min_tokens"] = _lax_int(body["min_tokens"], "min_tokens", errors)
    errors.raise_any()  # so no value below is _NOT_AN_INT
    _check_sampling(endpoint, limits, max_model_len)


def _check_sampling(endpoint: Endpoint, limits: dict[str, object], max_model_len: int | None) -> None:
    """The renderer's check of the output budget against the context, then ``SamplingParams._verify_args``
    on it. vLLM clamps the budget to the context the prompt leaves, which only lowers it: what is refused
    here it refuses too."""
    param, max_tokens = "max_tokens", limits.get("max_tokens", 16 if endpoint == "completions" else None)
    if endpoint == "chat" and limits.get("max_completion_tokens") is not None:
        param, max_tokens = "max_completion_tokens", limits["max_completion_tokens"]
    if max_model_len is not None and isinstance(max_tokens, int) and max_tokens > max_model_len:
        raise _refusal(f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                       "Please request fewer output tokens.", param, max_tokens)  # fmt: skip
    if isinstance(max_tokens, int) and max_tokens < 1:
        raise _refusal(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    min_tokens = limits.get("min_tokens", 0)
    if isinstance(min_tokens, int) and min_tokens < 0:
        raise _refusal(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if isinstance(max_tokens, int) and isinstance(min_tokens, int) and min_tokens > max_tokens:
        raise _refusal(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
