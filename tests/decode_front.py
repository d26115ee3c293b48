"""A stand-in in front of one real (or simulated) decode, for the proof's fault tests: it relays every
request, but hands decode what ``rewrite`` makes of each split request's body (wrong KV, a broken pull),
as a faulty connector or a confused proxy would. Read whole and answered whole: a stream's SSE body
reaches the proxy in one piece, which it relays the same."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pdserve import httpclient, protocol

Rewrite = Callable[[str, dict[str, Any]], dict[str, Any]]


class _Front(ThreadingHTTPServer):
    def __init__(self, target: str, rewrite: Rewrite) -> None:
        self.target, self.rewrite = target, rewrite
        self.rewritten: list[str] = []  # the X-Request-Id of each request rewritten
        super().__init__(("127.0.0.1", 0), _Relay)


class _Relay(BaseHTTPRequestHandler):
    server: _Front

    def _answer(self, response: httpclient.Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        self.wfile.write(response.body)

    def do_GET(self) -> None:
        self._answer(httpclient.get(self.server.target + self.path, 30))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request_id = self.headers.get("X-Request-Id", "")
        if body.get("kv_transfer_params"):
            body = self.server.rewrite(self.path, body)
            self.server.rewritten.append(request_id)
        headers = {"X-Request-Id": request_id} if request_id else None
        self._answer(httpclient.post_json(self.server.target + self.path, body, 180, headers=headers))

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def decode_front(target: str, rewrite: Rewrite) -> Iterator[tuple[str, _Front]]:
    """(the front's URL, the front)."""
    front = _Front(target, rewrite)
    thread = threading.Thread(target=front.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{front.server_address[1]}", front
    finally:
        front.shutdown()
        thread.join(timeout=10)
        front.server_close()


def with_last_word_changed(body: dict[str, Any], word: str) -> dict[str, Any]:
    """The body's prompt (or last message) with its last word replaced by ``word``."""
    if "prompt" in body:
        head, _, _ = str(body["prompt"]).rpartition(" ")
        return {**body, "prompt": f"{head} {word}"}
    messages = [dict(m) for m in body["messages"]]
    head, _, _ = str(messages[-1]["content"]).rpartition(" ")
    messages[-1]["content"] = f"{head} {word}"
    return {**body, "messages": messages}


def _token_ids(target: str, path: str, body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids as decode counts them (vLLM's /tokenize); None where there is none."""
    ask: dict[str, Any] = {"model": body.get("model")}
    if "prompt" in body:
        ask["prompt"] = body["prompt"]
    else:
        ask.update(messages=body["messages"], add_generation_prompt=True)
    response = httpclient.post_json(target + "/tokenize", ask, 60)
    data = response.json()
    return list(data["tokens"]) if response.status == 200 and isinstance(data, dict) else None


def last_block_swapped(prefill: str, target: str, word: str = "lighthouse") -> Rewrite:
    """Decode gets the KV of its own prompt but for one token of the last block: prefill computes that
    prompt (under the request's own salt, so it shares every full block before the change) and decode
    pulls those blocks, all right but the last, partial one.

    The changed token is the second to last: vLLM's decode recomputes the very last one after a full
    pull, which would mend a change there. Where decode has no /tokenize (the simulator), the prompt's
    last word is changed instead, as text."""

    def rewrite(path: str, body: dict[str, Any]) -> dict[str, Any]:
        client = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        ids = _token_ids(target, path, client)
        if ids is None:
            other_path, other = path, with_last_word_changed(client, word)
        else:
            k = len(ids) - 2
            ids[k] = next(t for t in (ids[k - 1], ids[k - 2], ids[k] + 1) if t != ids[k])
            other_path = "/v1/completions"
            other = {"model": client.get("model"), "prompt": ids, "temperature": 0.0,
                     "cache_salt": client.get("cache_salt")}  # fmt: skip
        response = httpclient.post_json(prefill + other_path, protocol.prefill_body(other), 180)
        assert response.status == 200, response.body[:300]
        return protocol.decode_body(client, protocol.kv_params_from_prefill(response.body))

    return rewrite
