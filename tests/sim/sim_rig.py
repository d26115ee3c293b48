"""Sim servers for the HTTP-layer tests: real uvicorn servers on free 127.0.0.1 ports, on their own event
loop in a thread (as a separate ``pdserve sim`` process would be), driven over sockets only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import orjson

from pdserve.prometheus import parse_prometheus
from pdserve.protocol import PREFILL_KV_PARAMS
from pdserve.sim.fleet import SimCluster
from pdserve.sim.profile import Profile

MODEL = "sim-model"
MAX_MODEL_LEN = 256
PROFILE = Profile(served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, num_blocks=512)
CLIENT_TIMEOUT = 15.0
# What a proxy sends prefill.
PREFILL_PARAMS = PREFILL_KV_PARAMS


@dataclass(frozen=True)
class Sims:
    cluster: SimCluster
    prefill: str  # base URLs
    decode: str
    both: str


def openai_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT
    )


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/sim/stats") as resp:
        assert resp.status == 200
        data = await resp.json()
    return dict(data["stats"])


async def set_faults(http: aiohttp.ClientSession, url: str, **changes: object) -> dict[str, object]:
    async with http.post(f"{url}/sim/faults", json=changes) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """A sample's value in ``url``'s /metrics, summed over label sets (0 when absent)."""
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return parse_prometheus(await resp.text()).get(name, 0.0)


# vLLM's answers to a failed KV load (non-streamed, and the streamed error event's JSON).
INTERNAL_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                            "code": 500}}  # fmt: skip
STREAM_ERROR = (b'{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, '
                b'"code": 500}}')  # fmt: skip
PROMPT = "the quick brown fox jumps over the lazy dog and keeps on running through the field"


async def post(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers.setdefault("Content-Type", "application/json")
    async with http.post(url, data=data, headers=headers) as resp:
        return resp.status, await resp.read()


def events(payload: bytes) -> list[Any]:
    """A stream's SSE events: parsed JSON, or the raw bytes for ``[DONE]``; asserts the framing."""
    assert payload.endswith(b"\n\n"), payload[-80:]
    out: list[Any] = []
    for block in payload[:-2].split(b"\n\n"):
        assert block.startswith(b"data: "), block
        data = block[len(b"data: ") :]
        out.append(data if data == b"[DONE]" else orjson.loads(data))
    return out


async def completion(http: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, Any]:
    status, payload = await post(http, f"{url}/v1/completions", {"model": MODEL, "prompt": PROMPT, **body})
    assert status == 200, payload
    return dict(orjson.loads(payload))


async def prefill(http: aiohttp.ClientSession, url: str, request_id: str, **body: Any) -> dict[str, Any]:
    req = {
        "model": MODEL,
        "prompt": PROMPT,
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    status, payload = await post(http, f"{url}/v1/completions", req, **{"X-Request-Id": request_id})
    assert status == 200, payload
    return dict(orjson.loads(payload))
