"""The seam of a migrated stream: a continuation's events rewritten into the stream the client already has.

A continuation (migrate.py) is a completions request of token ids on another instance; the client's stream
may be a chat one, with its own id, model and shape. ``Seam`` stands in for the client's ``Responder``
while the continuation is relayed (decode.py relays to it unchanged), parses every event (a migrated stream
is rare: its cost is not on the common path) and writes the client's own stream on:

- each token event in the shape of the last one the client got, text and logprobs carried over (the
  logprobs' ``text_offset`` moved on by what the client already has);
- stop strings judged here on the text of the whole answer, as vLLM's detokenizer does (``StopText``): the
  continuation is sent none, so a stop string spanning the seam ends the answer where the uninterrupted one
  would, and the text vLLM held back from the client before the failure is sent once the next token shows
  no stop string begins in it;
- usage counting the whole answer (prompt: the original prompt; completion: every token sent);
- ``[DONE]`` once, at the end.

Until the continuation's first event the Seam is "not started": a continuation that fails before it is
retried by the plan's usual rules on another instance, unseen by the client.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import orjson

from pdserve import sse
from pdserve.asgi import Message
from pdserve.protocol import Endpoint
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.request.progress import Progress, first_choice


class SeamEnded(Exception):
    """The client's stream has ended (a stop string found here): the continuation is no longer read."""


@dataclass(frozen=True)
class Resumed:
    """What the client already has, read from its stream when the migration began."""

    endpoint: Endpoint
    template: dict[str, Any]  # the last token event the client got: the shape of every event to come
    num_prompt_tokens: int
    num_sent: int  # completion tokens the client has had
    text: str  # the whole answer so far, including what vLLM held back for stop strings ("": unneeded)
    num_chars_sent: int  # how much of ``text`` the client has
    next_text_offset: int  # completions logprobs: where the next token's text begins
    show_ids: bool  # the client asked for token ids itself
    include_usage: bool
    continuous_usage: bool


async def _no_send(message: Message) -> None:
    raise AssertionError("a Seam writes through the client's Responder")


class Seam(Responder):
    def __init__(self, client: Responder, resumed: Resumed, progress: Progress, stops: StopText) -> None:
        super().__init__(_no_send, client.request_id)
        self._client = client
        self._r = resumed
        self._progress = progress
        self._stops = stops
        self._reader = sse.EventReader()
        self.num_tokens = 0  # this continuation's tokens the client got
        self.is_done = False  # the client's answer is complete (a finish sent)
        self.rejected: str | None = None  # the continuation was refused: why

    # --- the Responder interface decode.py relays through ---------------------------------------

    def name_instances(self, text: str) -> str:
        return self._client.name_instances(text)

    def error_event_relayed(self, failure: str) -> None:
        self.has_error_event = True
        self._client.error_event_relayed(failure)

    async def relay(self, status: int, content_type: str, body: bytes, failure: str | None = None) -> None:
        """A continuation refused or failed whole: the client's stream cannot go on from here."""
        self.rejected = failure or f"answered {status}"
        self.started = True

    async def open_stream(self, content_type: str) -> None:
        self.started = True  # the client's stream is open already

    async def chunk(self, data: bytes) -> None:
        out: list[bytes] = []
        for payload in self._reader.feed(data):
            if self.is_done:
                continue  # the answer is complete: the continuation's usage and [DONE] are ours to write
            if payload == sse.DONE_PAYLOAD:
                out.append(self._finish_events(None))
                continue
            if sse.error_of(payload) is not None:
                out.append(sse.event(payload))
                continue
            out.append(self._rewrite(orjson.loads(payload)))
        if out:
            await self._client.chunk(b"".join(out))
        if self.is_done and self._stopped_here:
            await self.end()
            raise SeamEnded()

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        if not self._client.finished:
            await self._client.end(data if not self.is_done else b"")

    # --- rewriting ----------------------------------------------------------------------------------

    _stopped_here = False

    def _rewrite(self, event: dict[str, Any]) -> bytes:
        choice = first_choice(event)
        if choice is None:
            return b""  # usage, counted here instead
        ids = choice.get("token_ids") or []
        self.num_tokens += len(ids)
        self._progress.add_ids(ids)
        delta, stop = self._stops.feed(choice.get("text") or "", self._r.num_sent + self.num_tokens)
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        if stop is not None:
            finish, stop_reason, self._stopped_here = "stop", stop, True
        elif finish is not None:
            delta += self._stops.flush()
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
            base = self._r.next_text_offset
            logprobs = {**logprobs, "text_offset": [base + o for o in logprobs["text_offset"]]}
        shaped = self._shaped(delta, logprobs, finish, stop_reason, ids)
        if event.get("usage") is not None and self._r.continuous_usage:
            shaped["usage"] = self._usage()
        encoded = sse.event(orjson.dumps(shaped))
        self._progress.sent(encoded)
        if finish is not None:
            self.is_done = True
            return encoded + self._finish_events(finish)
        return encoded

    def _shaped(
        self, delta: str, logprobs: Any, finish: str | None, stop_reason: Any, ids: list[int]
    ) -> dict[str, Any]:
        """An event of the client's stream: its template with this token's fields."""
        event = dict(self._r.template)
        choice = dict(event["choices"][0])
        if self._r.endpoint == "chat":
            choice["delta"] = {"content": delta}
        else:
            choice["text"] = delta
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        if finish is not None or "stop_reason" in choice:
            choice["stop_reason"] = stop_reason
        if "token_ids" in choice or self._r.show_ids:
            choice["token_ids"] = ids if self._r.show_ids else None
        event["choices"] = [choice]
        event.pop("usage", None)
        return event

    def _usage(self) -> dict[str, int]:
        num_completion = self._r.num_sent + self.num_tokens
        return {"prompt_tokens": self._r.num_prompt_tokens, "total_tokens":
                self._r.num_prompt_tokens + num_completion, "completion_tokens": num_completion}  # fmt: skip

    def _finish_events(self, finish: str | None) -> bytes:
        """What follows the last token event: usage if the client asked for it, then [DONE]."""
        self.is_done = True
        tail = b""
        if self._r.include_usage:
            t = self._r.template
            usage: dict[str, Any] = {"id": t.get("id"), "object": t.get("object"), "created": t.get("created"),
                     "model": t.get("model"), "choices": [], "usage": self._usage()}  # fmt: skip
            tail = sse.event(orjson.dumps(usage))
        return tail + sse.DONE


def check_stop_strings(
    text: str, num_new_chars: int, stops: list[str], include: bool
) -> tuple[str, int] | None:
    """vLLM's own rule (v1/engine/detokenizer.py): the stop string completing earliest in the new text,
    and the length to cut the text to (-1: none)."""
    if not num_new_chars or not stops:
        return None
    best: str | None = None
    best_index, best_end = 0, sys.maxsize
    for stop in stops:
        index = text.find(stop, 1 - num_new_chars - len(stop))
        if index != -1 and index + len(stop) < best_end:
            best, best_index, best_end = stop, index, index + len(stop)
    if best is None:
        return None
    if include:
        return (best, -1) if best_end >= len(text) else (best, best_end)
    return best, best_index


class StopText:
    """The answer's text with stop strings applied as vLLM applies them, and what of it the client has.

    vLLM holds back the last ``len(longest stop) - 1`` characters of a stream until the next token shows
    no stop string begins there (all of it once the answer finishes); so does this."""

    def __init__(
        self, stops: list[str], include: bool, min_tokens: int, text: str, num_chars_sent: int
    ) -> None:
        self._stops = stops
        self._include = include
        self._min_tokens = min_tokens
        self._text = text
        self._sent = num_chars_sent
        self._hold = max(len(s) for s in stops) - 1 if stops and not include else 0

    def feed(self, delta: str, num_tokens: int) -> tuple[str, str | None]:
        """The next token's text → what the client gets now, and the stop string it completed."""
        self._text += delta
        stop = None
        if self._stops and num_tokens > self._min_tokens:
            found = check_stop_strings(self._text, len(delta), self._stops, self._include)
            if found is not None:
                stop, cut = found
                if cut != -1:
                    self._text = self._text[:cut]
        end = len(self._text) if stop is not None else len(self._text) - self._hold
        if end <= self._sent:
            return "", stop
        out, self._sent = self._text[self._sent : end], end
        return out, stop

    def flush(self) -> str:
        """The answer finished: the rest of its text."""
        out, self._sent = self._text[self._sent :], len(self._text)
        return out
