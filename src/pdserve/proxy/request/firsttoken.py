"""The first token at once: a streamed client gets prefill's sampled token as soon as prefill answers,
and decode's stream goes on after it with that token's text taken out (docs/handover.md).

Decode samples the first token again from the same logits; the text is the same only when sampling is
deterministic (greedy, or seeded) and nothing holds text back (stop strings), so ``may_send_early``
refuses the rest, and ``FirstTokenCut`` checks decode's first token against prefill's. In bf16 two
instances' logits differ, and a near tie makes decode sample another token (seen on an H100). Then the
answer goes on from the token the client has: prefill named its prompt's and its token's ids (a stream a
migration may continue asks it for them), the early events carry them into the stream's ``Progress``,
and the continuation is the prompt plus that token (migrate.py), never decode's text after its own
token. Without those ids the stream ends with an error rather than a text no single instance would have
written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from pdserve import sse
from pdserve.protocol import Endpoint

_REPLACEMENT: Final = "\ufffd"  # what a detokenizer writes for an incomplete UTF-8 sequence


def may_send_early(body: dict[str, Any], is_stream: bool) -> bool:
    """Whether decode will sample prefill's first token again: a stream, greedy or seeded, asking nothing
    prefill's one-token answer lacks (logprobs) and nothing that makes vLLM hold text back (stop strings)."""
    if not is_stream:
        return False
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        return False
    if body.get("stop") or body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    temperature, seed = body.get("temperature"), body.get("seed")
    is_greedy = (
        isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0
    )
    return is_greedy or (isinstance(seed, int) and not isinstance(seed, bool))


class EarlyToken:
    """Prefill's token as the client's stream begins: the events to send, the text decode must repeat, and
    whether the events carry the prompt's and the token's ids (vLLM's ``return_token_ids`` keys)."""

    __slots__ = ("events", "has_ids", "text")

    def __init__(self, events: bytes, text: str, has_ids: bool = False) -> None:
        self.events = events
        self.text = text
        self.has_ids = has_ids


def early_token(endpoint: Endpoint, answer: Mapping[str, Any], with_ids: bool = False) -> EarlyToken | None:
    """The events that give the client prefill's token, or None when it must wait for decode: the token
    ended prefill's answer (EOS, a stop: decode may go otherwise with ``min_tokens``), or its text is
    empty or an incomplete character. ``with_ids``: the events carry prefill's prompt and token ids
    where vLLM's stream puts them, when its answer has them (one token)."""
    try:
        choice = answer["choices"][0]
        if choice.get("finish_reason") != "length":
            return None
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        head = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}
        # completions name the prompt's ids in the choice, chat in the answer
        prompt_ids = (choice if endpoint == "completions" else answer).get("prompt_token_ids")
        token_ids = choice.get("token_ids")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    if not isinstance(text, str) or not text or _REPLACEMENT in text:
        return None
    has_ids = with_ids and _ids(prompt_ids) and _ids(token_ids) and len(token_ids) == 1
    ids = {"prompt_token_ids": prompt_ids, "token_ids": token_ids} if has_ids else {}
    if endpoint == "completions":
        chunk = {**head, "object": "text_completion",
                 "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None, **ids}]}  # fmt: skip
        return EarlyToken(sse.event(orjson.dumps(chunk)), text, has_ids)
    role = {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}  # fmt: skip
    token = {**head, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}  # fmt: skip
    if has_ids:  # as vLLM streams them: the prompt's on the first chunk, each token's in its choice
        role["prompt_token_ids"] = prompt_ids
        token["choices"][0]["token_ids"] = token_ids
    return EarlyToken(sse.event(orjson.dumps(role)) + sse.event(orjson.dumps(token)), text, has_ids)


def _ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)


class FirstTokenMismatch(Exception):
    """Decode's first token is not the one the client already has."""


class FirstTokenCut:
    """Decode's stream less what the client already has: chat's role-only events before the first token
    and the first token's text (its event stays: token ids, finish reason and usage still count). Once
    past it, chunks go through untouched. ``has_ids``: the early events carried the prompt's and the
    token's ids, so decode's first event loses its prompt ids and its first token id too.

    vLLM merges the tokens of a stream its reader has not kept up with into one event, so the first
    text event may hold several tokens: prefill's text is cut from the front of decode's text."""

    __slots__ = ("_endpoint", "_expected", "_ids_left", "_left", "_pending", "has_ids", "is_done")

    def __init__(self, endpoint: Endpoint, expected: str, has_ids: bool = False) -> None:
        self._endpoint = endpoint
        self._expected = expected
        self._left = expected  # what of prefill's text decode has still to repeat
        self._pending = b""
        self.has_ids = has_ids
        self._ids_left = 1 if has_ids else 0  # prefill's token id, still to come in decode's ids
        self.is_done = False

    def feed(self, chunk: bytes) -> bytes:
        """``chunk`` as the client gets it (b"" while the first token's event is incomplete); raises
        ``FirstTokenMismatch``."""
        if self.is_done:
            return chunk
        *events, self._pending = (self._pending + chunk).split(b"\n\n")
        out = []
        for i, raw in enumerate(events):
            if self.is_done:
                out.append(b"\n\n".join(events[i:]) + b"\n\n")
                break
            out.append(self._cut(raw))
        if self.is_done:
            out.append(self._pending)
            self._pending = b""
        return b"".join(out)

    def _cut(self, raw: bytes) -> bytes:
        payload = raw.removeprefix(b"data: ")
        try:
            event = orjson.loads(payload)
            choice = event["choices"][0]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return raw + b"\n\n"  # an error event, [DONE], or usage alone: the relay's business
        holder, key = (
            (choice, "text") if self._endpoint == "completions" else (choice.get("delta") or {}, "content")
        )
        text = holder.get(key)
        if not text and not choice.get("token_ids") and not choice.get("finish_reason"):
            # chat's role event (the client had prefill's), or an event with nothing in it yet
            return b"" if self._endpoint == "chat" else raw + b"\n\n"
        text = text or ""
        if self.has_ids:
            self._drop_ids(event, choice)
        left = self._left
        if text.startswith(left):
            holder[key] = text[len(left) :]
            self._left = ""
            self.is_done = True
        elif left.startswith(text):
            holder[key] = ""
            self._left = left[len(text) :]
            self.is_done = bool(choice.get("finish_reason"))
        else:
            raise FirstTokenMismatch(f"decode's first token {text!r} is not prefill's {self._expected!r}")
        return sse.event(orjson.dumps(event))

    def _drop_ids(self, event: dict[str, Any], choice: dict[str, Any]) -> None:
        """What the early events named already: the prompt's ids and prefill's token id."""
        for holder in (event, choice):
            if holder.get("prompt_token_ids") is not None:
                holder["prompt_token_ids"] = None
        ids = choice.get("token_ids")
        if self._ids_left and isinstance(ids, list) and ids:
            choice["token_ids"] = ids[1:]
            self._ids_left = 0
