"""The vLLM instance `pdserve sim calibrate` measures, over HTTP: its facts, a pool of token ids to build
prompts from, and streamed completions timed chunk by chunk.

One aiohttp session per calibration (``open_probe``), without a connection limit so a batch's requests
run at once; aiohttp's errors become ``CalibrationError`` here and nowhere else.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve import sse
from pdserve.errors import CalibrationError

_REQUEST_TIMEOUT_S = 120.0
_POOL_TEXT = (  # any ordinary text: it only supplies valid token ids to sample prompts from
    "The scheduler admits waiting requests while blocks remain, computes prompts in chunks, then decodes every "
    "running sequence one token per step; prefill is bound by arithmetic, decode by memory bandwidth. Quick "
    "brown foxes jump over lazy dogs; zebras quietly vex jumping kangaroos near 42 oxen and 7 yaks."
)


@dataclass(frozen=True)
class Sample:
    """One streamed completion: when it was sent and when each chunk of tokens arrived."""

    prompt_tokens: int
    sent_at: float  # perf_counter seconds
    chunks: tuple[tuple[float, int], ...]  # (arrival time, tokens in the chunk), in order


class Probe:
    """The vLLM instance under test, reached through the calibration's session."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url.rstrip("/")

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> str:
        """The body of a 200 answer; CalibrationError for anything else."""
        try:
            async with self.session.request(method, self.url + path, json=body) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CalibrationError(f"{method} {self.url}{path} failed: {exc!r}") from exc
        if resp.status != 200:
            raise CalibrationError(f"{method} {self.url}{path} answered {resp.status}: {text[:300]}")
        return text

    async def token_pool(self, model: str) -> list[int]:
        """Distinct token ids of a fixed text, from vLLM's /tokenize."""
        body = {"model": model, "prompt": _POOL_TEXT, "add_special_tokens": False}
        pool = sorted(set(json.loads(await self.call("POST", "/tokenize", body)).get("tokens") or ()))
        if len(pool) < 20:
            raise CalibrationError(f"/tokenize gave only {len(pool)} distinct tokens; cannot build prompts")
        return pool

    async def complete(self, model: str, prompt: list[int], max_tokens: int) -> Sample:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # tokens per chunk, so coalesced chunks are counted right
        }
        chunks: list[tuple[float, int]] = []
        usage: dict[str, Any] = {}
        sent_at = time.perf_counter()
        try:
            async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise CalibrationError(f"completion answered {resp.status}: {(await resp.text())[:300]}")
                reader = sse.EventReader()
                async for raw in resp.content.iter_any():
                    now = time.perf_counter()
                    for payload in reader.feed(raw):
                        if payload == sse.DONE_PAYLOAD:
                            continue
                        error = sse.error_of(payload)
                        if error is not None:
                            raise CalibrationError(f"completion failed mid-stream: {error}")
                        event = json.loads(payload)
                        usage = event.get("usage") or usage
                        for choice in event.get("choices") or ():
                            num = len(choice.get("token_ids") or ()) or (1 if choice.get("text") else 0)
                            if num:
                                chunks.append((now, num))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CalibrationError(f"completion to {self.url} failed: {exc!r}") from exc
        if not chunks or usage.get("completion_tokens") != max_tokens:
            raise CalibrationError(f"expected {max_tokens} tokens; got usage {usage}, {len(chunks)} chunks")
        return Sample(int(usage.get("prompt_tokens", len(prompt))), sent_at, tuple(chunks))

    async def discover(self) -> dict[str, Any]:
        """Model name, context length, block size and KV blocks, from /v1/models and /metrics."""
        models = json.loads(await self.call("GET", "/v1/models")).get("data") or []
        if not models:
            raise CalibrationError(f"{self.url}/v1/models lists no model")
        found: dict[str, Any] = {"served_model_name": models[0]["id"]}
        if models[0].get("max_model_len"):
            found["max_model_len"] = int(models[0]["max_model_len"])
        info = re.search(r"^vllm:cache_config_info\{(.*)\}", await self.call("GET", "/metrics"), re.MULTILINE)
        if info is None:
            raise CalibrationError(f"{self.url}/metrics has no vllm:cache_config_info")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
        for label, field in (("block_size", "block_size"), ("num_gpu_blocks", "num_blocks")):
            if labels.get(label, "").isdigit():
                found[field] = int(labels[label])
        return found


@asynccontextmanager
async def open_probe(url: str) -> AsyncIterator[Probe]:
    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        yield Probe(session, url)
