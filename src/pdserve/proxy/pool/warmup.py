"""A returning instance warms its NIXL handshakes with its peers before it takes requests.

vLLM's decode meets a prefill engine on its first pull from it: the pull starts the handshake (a ZMQ
round trip for the agent metadata, then UCX's connection) and waits for it (NixlConnector's
``_background_nixl_handshake``). A restarted instance has a new engine id, so every peer meets it
afresh, and without a warm-up the first requests after a restart each pay that on their TTFT, at the
moment the pool is busiest (the requests the outage held back arrive together).

So an instance that comes back (the launcher says "ready", or a health check passes after checks
that could not connect: a new process; one that merely stalled keeps its handshakes) is ``warming``: one canary handoff per pair with the instances of the other role in
service (a short prompt through the prefill side with ``do_remote_decode``, one token pulled and
computed on the decode side), then it serves. In an elastic pool, where any instance takes either
side, both directions with every other instance. A canary that fails is logged and counted, never
held against the instance: its health checks already passed. While it warms the instance is still a
panic candidate, so a pool with no other instance of that role serves from it at once.

Each canary's prompt is token ids under a fresh ``cache_salt``: no prefix cache on either side matches
it, so the decode side pulls (a prompt found in decode's cache would skip the pull and the handshake).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping

import orjson

from pdserve import protocol
from pdserve.errors import UpstreamError
from pdserve.proxy.pool.instance import Instance

log = logging.getLogger("pdserve.proxy")

# Three blocks of 16 tokens and a few more: a prompt shorter than a block has no full block to pull,
# and the decode side would then skip the pull (and the handshake this is for). Ids well inside any
# vocabulary.
_CANARY_PROMPT = [100 + i % 50 for i in range(52)]


async def warm_pair(
    prefill: Instance, decode: Instance, headers: Mapping[str, str], timeout_s: float
) -> str | None:
    """One canary handoff from ``prefill`` to ``decode``: None when decode pulled, or what went wrong."""
    started = time.monotonic()
    salt = f"warmup-{uuid.uuid4().hex[:16]}"
    body = {"prompt": _CANARY_PROMPT, "max_tokens": 1, "temperature": 0.0, "cache_salt": salt}
    request_id = f"warmup-{uuid.uuid4().hex[:12]}"
    sent = {**headers, "X-Request-Id": request_id}
    path = protocol.PATHS["completions"]
    try:
        reply = await prefill.upstream.post(
            path, orjson.dumps(protocol.prefill_body(body)), sent, "prefill", timeout_s
        )
        if reply.status != 200:
            return f"prefill {prefill.url} answered {reply.status}: {reply.body[:200]!r}"
        try:
            params = protocol.kv_params_from_prefill(reply.body)
        except ValueError as exc:
            return f"prefill {prefill.url}: {exc}"
        left = max(0.1, timeout_s - (time.monotonic() - started))
        reply = await decode.upstream.post(
            path, orjson.dumps(protocol.decode_body(body, params)), sent, "decode", left
        )
    except UpstreamError as exc:
        return exc.detail
    if reply.status != 200:
        return f"decode {decode.url} answered {reply.status}: {reply.body[:200]!r}"
    return None


def pairs_of(instance: Instance, peers: list[Instance], elastic: bool) -> list[tuple[Instance, Instance]]:
    """(prefill side, decode side) of every handoff the returning ``instance`` takes part in."""
    others = [p for p in peers if p is not instance]
    if elastic:
        return [pair for other in others for pair in ((instance, other), (other, instance))]
    if instance.role == "prefill":
        return [(instance, other) for other in others]
    return [(other, instance) for other in others]


async def warm(
    pairs: list[tuple[Instance, Instance]], headers: Mapping[str, str], timeout_s: float
) -> list[str]:
    """Every pair's canary at once, within ``timeout_s``; what went wrong, one line per failed pair."""
    if not pairs:
        return []
    try:
        async with asyncio.timeout(timeout_s):
            results = await asyncio.gather(*(warm_pair(p, d, headers, timeout_s) for p, d in pairs))
    except TimeoutError:
        return [f"the canaries took longer than {timeout_s:g} s"]
    return [f"{p.url} → {d.url}: {error}" for (p, d), error in zip(pairs, results, strict=True) if error]
