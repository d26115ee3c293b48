"""The first token at once: a streamed client gets prefill's sampled token as soon as prefill answers,
and decode's stream goes on after it with that token's text taken out (docs/handover.md).

Decode samples the first token again from the same logits; the text is the same only when sampling is
deterministic (greedy, or seeded) and nothing holds text back (stop strings), so ``may_send_early``
refuses the rest, and ``FirstTokenCut`` checks decode's first token against prefill's: a different one
ends the stream with an error rather than a text no single instance would have written.
"""

from __future__ import annotations

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
    """Prefill's token as the client's stream begins: the events to send, and the text decode must repeat."""

    __slots__ = ("events", "text")

    def __init__(self, events: bytes, text: str) -> None:
        self.events = events
        self.text = text


def early_token(endpoint: Endpoint, prefill_answer: bytes) -> EarlyToken | None:
    """The events that give the client prefill's token, or None when it must wait for decode: the token
    ended prefill's answer (EOS, a stop: decode may go otherwise with ``min_tokens``), or its text is
    empty or an incomplete character."""
    try:
        answer = orjson.loads(prefill_answer)
        choice = answer["choices"][0]
        if choice.get("finish_reason") != "length":
            return None
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        head = {"id": answer["id"], "created": answer["created"], "model": answer["model"]}
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(text, str) or not text or _REPLACEMENT in text:
        return None
    if endpoint == "completions":
        chunk = {**head, "object": "text_completion",
                 "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}  # fmt: skip
        return EarlyToken(sse.event(orjson.dumps(chunk)), text)
    events = b""
    for delta in ({"role": "assistant", "content": ""}, {"content": text}):
        chunk = {**head, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}  # fmt: skip
        events += sse.event(orjson.dumps(chunk))
    return EarlyToken(events, text)


class FirstTokenMismatch(Exception):
    """Decode's first token is not the one the client already has."""


class FirstTokenCut:
    """Decode's stream less what the client already has: chat's role-only events before the first token
    and the first token's text (its event stays: token ids, finish reason and usage still count). Once
    past it, chunks go through untouched.

    vLLM merges the tokens of a stream its reader has not kept up with into one event, so the first
    text event may hold several tokens: prefill's text is cut from the front of decode's text."""

    __slots__ = ("_endpoint", "_expected", "_left", "_pending", "is_done")

    def __init__(self, endpoint: Endpoint, expected: str) -> None:
        self._endpoint = endpoint
        self._expected = expected
        self._left = expected  # what of prefill's text decode has still to repeat
        self._pending = b""
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
