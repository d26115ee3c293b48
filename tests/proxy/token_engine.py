"""A scripted vLLM for the in-memory upstream (memory_upstream.py) that generates tokens the way a model
does: each next token a function of every token before it (greedy), so an answer continued from the
prompt plus the tokens already generated is the uninterrupted one, token for token.

It speaks what the migration relies on: ``return_token_ids`` (``token_ids`` in each choice, the prompt's
on the first event, ``null`` when not asked), a prompt given as token ids, stop strings with vLLM's
hold-back, completions logprobs with text offsets, usage, and ``/detokenize``. ``breaks`` makes a stream
fail after a number of events, the way a dying or stalled decode does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from memory_upstream import Answer, Script

from pdserve import sse
from pdserve.errors import UpstreamError

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e0",
          "remote_request_id": "cmpl-r-0-00000000", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}  # fmt: skip


def tokenize(text: str) -> list[int]:
    return [1000 + ord(c) % 50 for c in text]


def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
    return [7, *(t for m in messages for t in tokenize(str(m.get("content")))), 8]


def next_token(context: list[int]) -> int:
    return (context[-1] * 7 + len(context) * 3 + sum(context[-3:])) % 40


def word(token: int) -> str:
    return " " + "abcdefghij"[token % 10] + str(token)


def detokenize(ids: list[int]) -> str:
    return "".join(word(t) for t in ids)


def _stop_at(text: str, new: int, stops: list[str]) -> int | None:
    """Where the first stop string completing in the last ``new`` characters begins."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, len(text) - new - len(stop) + 1))
        if at != -1 and (best is None or at + len(stop) < best[1]):
            best = (at, at + len(stop))
    return None if best is None else best[0]


def generate(body: dict[str, Any], chat: bool) -> tuple[list[int], list[dict[str, Any]]]:
    """The prompt's ids and one dict per token: its id, the text the stream shows with it (vLLM's
    hold-back for stop strings), finish and stop reason."""
    prompt = body.get("prompt")
    ids = chat_ids(body["messages"]) if chat else prompt if isinstance(prompt, list) else tokenize(prompt)
    budget = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    stop = body.get("stop") or []
    stops = [stop] if isinstance(stop, str) else list(stop)
    hold = max((len(s) for s in stops), default=1) - 1
    context, text, shown, steps = list(ids), "", 0, []
    for i in range(budget):
        token = next_token(context)
        context.append(token)
        piece = word(token)
        text += piece
        at = _stop_at(text, len(piece), stops) if stops else None
        finish = "stop" if at is not None else "length" if i == budget - 1 else None
        if at is not None:
            text = text[:at]
        end = len(text) if finish else len(text) - hold
        delta, shown = (text[shown:end], end) if end > shown else ("", shown)
        step = {"token": token, "text": delta, "finish": finish, "stop": stops[0] if at is not None else None}
        steps.append(step)
        if finish:
            break
    return ids, steps


def events(body: dict[str, Any], chat: bool, name: str) -> list[bytes]:
    """The SSE events vLLM would stream for ``body``."""
    ids, steps = generate(body, chat)
    asked = body.get("return_token_ids") is True
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{name}", "object": "chat.completion.chunk" if chat
            else "text_completion", "created": 1, "model": "m"}  # fmt: skip
    out: list[bytes] = []
    if chat:
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        out.append(
            sse.event(orjson.dumps({**base, "choices": [role], "prompt_token_ids": ids if asked else None}))
        )
    offset = 0
    for i, step in enumerate(steps):
        logprobs = None
        if not chat and body.get("logprobs") is not None:
            tok = word(step["token"])
            lp = -(step["token"] % 7) / 10
            logprobs = {
                "text_offset": [offset],
                "token_logprobs": [lp],
                "tokens": [tok],
                "top_logprobs": [{tok: lp}],
            }
            offset += len(tok)
        tids = [step["token"]] if asked else None
        if chat:
            choice = {"index": 0, "delta": {"content": step["text"]}, "logprobs": None,
                      "finish_reason": step["finish"], "token_ids": tids}  # fmt: skip
            if step["finish"]:
                choice["stop_reason"] = step["stop"]
        else:
            choice = {"index": 0, "text": step["text"], "logprobs": logprobs, "finish_reason": step["finish"],
                      "stop_reason": step["stop"], "prompt_token_ids": ids if asked and i == 0 else None,
                      "token_ids": tids}  # fmt: skip
        out.append(sse.event(orjson.dumps({**base, "choices": [choice]})))
    if (body.get("stream_options") or {}).get("include_usage"):
        n = len(steps)
        usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + n, "completion_tokens": n}
        out.append(sse.event(orjson.dumps({**base, "choices": [], "usage": usage})))
    return [*out, sse.DONE]


def whole(body: dict[str, Any], chat: bool, name: str) -> bytes:
    ids, steps = generate(body, chat)
    text = "".join(s["text"] for s in steps)
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}}
        if chat
        else {"index": 0, "text": text}
    )
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": len(steps),
        "total_tokens": len(ids) + len(steps),
    }
    return orjson.dumps({"id": name, "choices": [{**choice, "finish_reason": steps[-1]["finish"]}],
                         "usage": usage, "kv_transfer_params": None})  # fmt: skip


def engine(
    name: str,
    breaks: Callable[[int], None] | None = None,
    whole_breaks: UpstreamError | None = None,
    cut_after: int | None = None,
) -> Script:
    """One instance: prefill (kv params), decode or whole, streamed or not, and ``/detokenize``.
    ``breaks(i)`` runs before streamed event i of every generation it serves (it may raise);
    ``whole_breaks`` fails every whole answer; ``cut_after``: streams end after that many events."""

    def answer(body: dict[str, Any]) -> Answer:
        if "tokens" in body:
            return Answer(body=orjson.dumps({"prompt": detokenize(body["tokens"])}))
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return Answer(body=orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}))
        chat = "messages" in body
        if body.get("stream"):
            chunks = events(body, chat, name)[:cut_after]
            return Answer(chunks=chunks, content_type="text/event-stream", before_chunk=breaks)
        if whole_breaks is not None:
            raise whole_breaks
        return Answer(body=whole(body, chat, name))

    return answer


def dies_after(k: int, error: UpstreamError) -> Callable[[int], None]:
    """A stream that fails with ``error`` once ``k`` events are out."""

    def before(i: int) -> None:
        if i == k:
            raise error

    return before
