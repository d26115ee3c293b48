"""An elastic pool measures itself before its first request, so the router's first placements already
know how far its step costs are from these instances.

The cost model's step costs are a profile's, measured on one GPU with each instance on its own; on another
GPU, with the pool's instances sharing one, or on vLLM for CPUs, they can be off by several times, and
until a kind of placement has measured ``MIN_SAMPLES`` requests of its own the router would take them at
their word (calibrator.py). So once two instances serve, a handful of lone requests measure both kinds:

- whole on one instance: one token (its TTFT; after one not counted, which may pay for the engine's
  warm-up), then the same prompt asking ``_TOKENS`` (the difference, per token, its TPOT);
- split: prefill on one, decode on the other pulling the KV, the same two ways, after one handoff that
  is not counted (the pair's first pull may start the NIXL handshake).

Each is non-streamed (the whole answer's time is what is measured), at temperature 0 with ``ignore_eos``
so its length is exact, under a fresh ``cache_salt`` so no prefix cache shortens it. Measured over what
the model predicts for a lone request (judging.alone), each kind's factors calibrate it from the first
request on; its own requests replace them once they count. A measurement that fails is logged and
leaves the model as it is: the requests calibrate it then, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from pdserve import protocol
from pdserve.errors import UpstreamError
from pdserve.proxy.pool.elastic import ElasticRouter, Measured
from pdserve.proxy.pool.instance import Instance

log = logging.getLogger("pdserve.proxy")

# Sixteen blocks of 16 tokens: long enough for a pull of several blocks, short enough to cost little.
_PROMPT = [100 + i % 50 for i in range(256)]
_TOKENS = 33


async def measure(
    router: ElasticRouter, members: Sequence[Instance], headers: Mapping[str, str], timeout_s: float
) -> str | None:
    """Measure both kinds on ``members`` (whole on the first; split from the first to the second, when
    there is one) and hand the router what they measured; None when done, else what went wrong."""
    if not members:
        return "no instance in service"
    first, second = members[0], members[1] if len(members) > 1 else None
    try:
        await _whole(first, 1, headers, timeout_s)  # an engine's first request may pay for its warm-up
        one = await _whole(first, 1, headers, timeout_s)
        many = await _whole(first, _TOKENS, headers, timeout_s)
        whole = _measured(one, many)
        if not router.measured_alone(False, len(_PROMPT), _TOKENS, whole):
            return f"whole: measured {whole}, nothing the model can be compared to"
        if second is None:
            return None
        # The pair's first handoff may pay for the NIXL handshake (seconds on CPU): not a TTFT to learn.
        await _split(first, second, 1, headers, timeout_s)
        one = await _split(first, second, 1, headers, timeout_s)
        many = await _split(first, second, _TOKENS, headers, timeout_s)
        split = _measured(one, many)
        if not split.tpot_s > 0:
            # The tokens came quicker than the noise between two handoffs: decode's steps are the same
            # steps whole or split, so the whole measurement's pace stands for them.
            split = Measured(split.ttft_s, whole.tpot_s)
        if not router.measured_alone(True, len(_PROMPT), _TOKENS, split):
            return f"split: measured {split}, nothing the model can be compared to"
    except (UpstreamError, ValueError) as exc:
        return str(exc)
    return None


async def run(
    router: ElasticRouter, members: Callable[[], Sequence[Instance]], headers: Mapping[str, str],
    timeout_s: float, interval_s: float, wanted: int = 2,
) -> None:  # fmt: skip
    """``measure`` once ``wanted`` instances serve (two; one for a pool of one), asking every
    ``interval_s``; the proxy's lifespan runs it beside the health checks."""
    while True:
        serving = members()
        if serving and len(serving) >= wanted:
            break
        await asyncio.sleep(interval_s)
    began = time.monotonic()
    error = await measure(router, serving, headers, timeout_s)
    if error is not None:
        log.warning("elastic pool: the start-up measurement failed (%s); the requests will calibrate", error)
        return
    log.info("elastic pool: measured at start-up in %.2f s; calibration %s", time.monotonic() - began,
             router.calibration)  # fmt: skip


def _measured(one: float, many: float) -> Measured:
    return Measured(one, max(0.0, many - one) / (_TOKENS - 1))


def _body(max_tokens: int) -> dict[str, Any]:
    return {"prompt": _PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": f"startup-{uuid.uuid4().hex[:16]}"}  # fmt: skip


async def _whole(instance: Instance, max_tokens: int, headers: Mapping[str, str], timeout_s: float) -> float:
    started = time.perf_counter()
    reply = await instance.upstream.post(
        protocol.PATHS["completions"], orjson.dumps(_body(max_tokens)), _headers(headers), "decode", timeout_s
    )
    if reply.status != 200:
        raise ValueError(f"{instance.url} answered {reply.status}: {reply.body[:200]!r}")
    return time.perf_counter() - started


async def _split(prefill: Instance, decode: Instance, max_tokens: int, headers: Mapping[str, str],
                 timeout_s: float) -> float:  # fmt: skip
    body = _body(max_tokens)
    path = protocol.PATHS["completions"]
    started = time.perf_counter()
    reply = await prefill.upstream.post(
        path, orjson.dumps(protocol.prefill_body(body)), _headers(headers), "prefill", timeout_s
    )
    if reply.status != 200:
        raise ValueError(f"prefill {prefill.url} answered {reply.status}: {reply.body[:200]!r}")
    params = protocol.kv_params_from_prefill(reply.body)
    reply = await decode.upstream.post(
        path, orjson.dumps(protocol.decode_body(body, params)), _headers(headers), "decode", timeout_s
    )
    if reply.status != 200:
        raise ValueError(f"decode {decode.url} answered {reply.status}: {reply.body[:200]!r}")
    return time.perf_counter() - started


def _headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {**headers, "X-Request-Id": f"startup-{uuid.uuid4().hex[:12]}"}
