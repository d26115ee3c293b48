"""A fake vLLM instance with NixlConnector, close enough for the proxy (shapes as docs/vllm.md's protocol).

A Starlette app that records every request it gets; a test sets ``fault`` to make it misbehave the way
real instances do. proxy_rig.py serves it over a real socket.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "tiny"
MAX_MODEL_LEN = 2048

Fault = Literal[
    "fail",  # 500 "Internal server error", as vLLM answers a failed KV pull (non-streamed)
    "hang",  # never answer; only the caller hanging up ends the request
    "no_kv_params",  # 200 without kv_transfer_params: an instance started without NixlConnector
    "drop",  # stream two chunks, then close the connection without ending the response
    "error_event",  # 200, one chunk, vLLM's error event, [DONE]: a failure mid-generation, streamed
    "error_event_first",  # 200, vLLM's error event, [DONE]: a failed KV pull, streamed
    "stall",  # stream two chunks, then nothing until the caller hangs up
    "endless",  # a chunk every 50 ms until the caller hangs up
    "trickle",  # a normal stream whose final "data: [DONE]" goes out one byte at a time
]  # the stream faults (drop, error_event*, stall, endless) apply to streamed requests only


class ConnectionDropped(Exception):
    """Raised mid-stream on purpose: uvicorn then closes the socket with the response unfinished."""


@dataclass(frozen=True)
class Seen:
    """One request as the fake received it."""

    method: str
    path: str
    body: dict[str, Any] | None  # None for GETs and for bodies that are not JSON
    headers: dict[str, str]  # lower-case names


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class FakeVLLM:
    def __init__(self, role: str, model: str = MODEL) -> None:
        self.role = role
        self.model = model
        self.engine_id = f"{role}-{secrets.token_hex(4)}"
        self.fault: Fault | None = None
        self.requests: list[Seen] = []
        self.issued_kv_params: list[dict[str, Any]] = []  # what it answered do_remote_decode with
        self._disconnects: list[str] = []  # X-Request-Id of requests the caller closed before the end
        self._changed = threading.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self.app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
            ]
        )

    def reset(self) -> None:
        self.fault = None
        self.issued_kv_params.clear()
        with self._changed:
            self.requests.clear()
            self._disconnects.clear()

    def text(self, num_tokens: int) -> str:
        """The answer this fake generates for ``num_tokens`` tokens (distinct per role)."""
        return "".join(f" {self.role}{i}" for i in range(num_tokens))

    def generations(self) -> list[Seen]:
        return [r for r in self.requests if r.method == "POST"]

    def wait_for_request(self, request_id: str, timeout: float) -> bool:
        """True once a request with X-Request-Id ``request_id`` has arrived."""
        with self._changed:
            return self._changed.wait_for(
                lambda: any(r.headers.get("x-request-id") == request_id for r in self.requests), timeout
            )

    def wait_for_disconnect(self, request_id: str, timeout: float) -> bool:
        """True once the caller closed request ``request_id`` before its answer was complete."""
        with self._changed:
            return self._changed.wait_for(lambda: request_id in self._disconnects, timeout)

    def _record(self, request: Request, body: dict[str, Any] | None) -> None:
        headers = {k.lower(): v for k, v in request.headers.items()}
        with self._changed:
            self.requests.append(Seen(request.method, request.url.path, body, headers))
            self._changed.notify_all()

    def _watch(self, request: Request, request_id: str, finished: asyncio.Event) -> asyncio.Event:
        """An event set when the caller hangs up; recorded unless the answer was already complete."""
        gone = asyncio.Event()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            if not finished.is_set():
                with self._changed:
                    self._disconnects.append(request_id)
                    self._changed.notify_all()
            gone.set()

        task = asyncio.create_task(watch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return gone

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        self._record(request, None)
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm", "root": self.model}
        return JSONResponse(
            {"object": "list", "data": [{**model, "parent": None, "max_model_len": MAX_MODEL_LEN}]}
        )

    async def _generate(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            self._record(request, None)
            return error_response(400, f"Invalid JSON: {exc}", "BadRequestError")
        self._record(request, body)
        request_id = request.headers.get("x-request-id") or secrets.token_hex(16)
        fault = self.fault
        if fault == "fail":
            return error_response(500, "Internal server error", "InternalServerError")
        if fault == "hang":
            await self._watch(request, request_id, asyncio.Event()).wait()
            return Response(status_code=499)  # never delivered: the caller has gone
        if body.get("model", self.model) != self.model:
            message = f"The model `{body['model']}` does not exist. Valid aliases: {self.model}"
            return error_response(404, message, "NotFoundError")
        num_tokens = next(
            (body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), 4
        )
        if not isinstance(num_tokens, int) or num_tokens < 1:
            message = f"max_tokens must be at least 1, got {num_tokens}."
            return error_response(400, message, "BadRequestError", "max_tokens")
        # vLLM clamps the output budget to the context the prompt leaves (one word a token here), then
        # checks min_tokens against it: a refusal the proxy cannot see coming without a tokenizer.
        budget = min(num_tokens, MAX_MODEL_LEN - len(str(body.get("prompt") or body.get("messages")).split()))
        min_tokens = body.get("min_tokens", 0)
        if isinstance(min_tokens, int) and min_tokens > budget:
            message = f"min_tokens must be less than or equal to max_tokens={budget}, got {min_tokens}."
            return error_response(400, message, "BadRequestError")
        chat = request.url.path.endswith("/chat/completions")
        prompt = body.get("prompt")
        is_batch = isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)
        num_choices = (len(prompt) if is_batch else 1) * (body.get("n") or 1)
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
        }
        if body.get("stream"):
            finished = asyncio.Event()
            gone = self._watch(request, request_id, finished)
            events = self._events(chat, base, num_choices, num_tokens, body, fault, finished, gone)
            return StreamingResponse(events, media_type="text/event-stream")
        kv_params = None
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode") and fault != "no_kv_params":
            kv_params = self._kv_params(request_id)
        text = self.text(num_tokens)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat
            else {"index": i, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            for i in range(num_choices)
        ]
        usage = {"prompt_tokens": 5, "completion_tokens": num_tokens, "total_tokens": 5 + num_tokens}
        return JSONResponse({**base, "choices": choices, "usage": usage, "kv_transfer_params": kv_params})

    def _kv_params(self, request_id: str) -> dict[str, Any]:
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"cmpl-{request_id}-0-{secrets.token_hex(4)}",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": 5,
            "remote_blocks_expiry_time": time.perf_counter() + 30,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }
        self.issued_kv_params.append(params)
        return params

    async def _events(
        self,
        chat: bool,
        base: dict[str, Any],
        num_choices: int,
        num_tokens: int,
        body: dict[str, Any],
        fault: Fault | None,
        finished: asyncio.Event,
        gone: asyncio.Event,
    ) -> AsyncIterator[bytes]:
        base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
        i = 0
        while i < num_tokens or fault == "endless":
            if fault in ("drop", "stall") and i == 2:
                if fault == "drop":
                    raise ConnectionDropped(f"fake {self.role} dropped the connection on purpose")
                await gone.wait()
                return
            if (fault == "error_event" and i == 1) or (fault == "error_event_first" and i == 0):
                error = {"message": "KV transfer failed", "type": "InternalServerError", "param": None}
                yield b"data: " + orjson.dumps({"error": {**error, "code": 500}}) + b"\n\n"
                finished.set()
                yield b"data: [DONE]\n\n"
                return
            if fault == "endless":
                await asyncio.sleep(0.05)  # pacing of the fake's own output, not synchronisation
            token = f" {self.role}{i}"
            finish = "length" if i == num_tokens - 1 else None
            for index in range(num_choices):
                part = {"delta": {"role": "assistant", "content": token}} if chat else {"text": token}
                choice = {"index": index, **part, "logprobs": None, "finish_reason": finish}
                yield b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"
            i += 1
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": num_tokens, "total_tokens": 5 + num_tokens}
            yield b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
        finished.set()
        if fault != "trickle":
            yield b"data: [DONE]\n\n"
            return
        for byte in b"data: [DONE]\n\n":
            await asyncio.sleep(0.01)  # pacing, so each byte reaches the proxy in its own read
            yield bytes([byte])
