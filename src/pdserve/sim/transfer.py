"""How a sim decode reads a sim prefill's held KV: the simulator's NIXL.

Before it reads, decode pairs its tensor-parallel size with the holder's (``tp_size`` in prefill's
params) by vLLM's rules (tppairing.py): a pair vLLM cannot map fails the pull, as vLLM's handshake does.
A pull goes to the holder named by ``remote_engine_id``: straight to its engine when that instance lives
in this process (the registry), else over HTTP to ``http://remote_host:remote_port/sim/kv/pull`` on one
pooled aiohttp session per process. Either way the holder releases the blocks as vLLM's prefill does once
decode's read completes, and a failure of any kind reaches the engine as ``KVPullError`` (aiohttp's
errors are translated here and nowhere else). A read of blocks the holder no longer holds is not a
failure, as in vLLM: it returns ``is_intact`` False and decode computes on someone else's KV. A holder
that restarted has a new engine id, so reads of its old params fail at once (404 here, vLLM's 500).

Heartbeats (``heartbeat``) go the same way, ``POST /sim/kv/heartbeat`` across processes, unanswered by
design: like vLLM's NIXL notification, a lost one is simply not there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final, Protocol

import aiohttp
import orjson

from pdserve.errors import ConfigError, KVPullError
from pdserve.sim.faults import Faults
from pdserve.sim.profile import Profile
from pdserve.sim.types import HeldKV, RemoteKV
from pdserve.sim.vllm_metrics import SimMetrics
from pdserve.tppairing import pair_tp

log = logging.getLogger("pdserve.sim")

PULL_PATH: Final = "/sim/kv/pull"
HEARTBEAT_PATH: Final = "/sim/kv/heartbeat"
# vLLM gives up on an unreachable prefill side channel after about 5 s (docs/vllm.md).
PULL_TIMEOUT_S: Final = 5.0
# Bytes of KV per token for vllm:nixl_bytes_transferred when the profile does not say: the tiny Llama
# (2 layers × K and V × 1 KV head × head_dim 64 × fp32 = 1 KiB).


class KVHolder(Protocol):
    """An in-process instance that can serve pulls of the KV it holds."""

    def serve_pull(self, request_id: str) -> HeldKV: ...

    def heartbeat(self, request_ids: tuple[str, ...]) -> None: ...


class KVRegistry:
    """The sim instances of this process by engine id, and the HTTP session for pulls from the others."""

    def __init__(self) -> None:
        self._holders: dict[str, KVHolder] = {}
        self._session: aiohttp.ClientSession | None = None

    def register(self, engine_id: str, holder: KVHolder) -> None:
        self._holders[engine_id] = holder

    def unregister(self, engine_id: str) -> None:
        self._holders.pop(engine_id, None)

    def holder(self, engine_id: str) -> KVHolder | None:
        return self._holders.get(engine_id)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def held_to_mapping(held: HeldKV) -> dict[str, Any]:
    return {
        "block_ids": list(held.block_ids),
        "num_tokens": held.num_tokens,
        "num_cached_tokens": held.num_cached_tokens,
        "expires_at": held.expires_at,
        "is_intact": held.is_intact,
        "prompt_digest": held.prompt_digest,
    }


def held_from_mapping(data: Any) -> HeldKV:
    try:
        return HeldKV(
            block_ids=tuple(int(b) for b in data["block_ids"]),
            num_tokens=int(data["num_tokens"]),
            expires_at=float(data["expires_at"]),
            num_cached_tokens=int(data["num_cached_tokens"]),
            is_intact=bool(data.get("is_intact", True)),
            prompt_digest=int(data.get("prompt_digest", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise KVPullError(f"malformed pull answer: {exc}") from exc


class PullSource:
    """One decode instance's ``KVSource``: injected failures, then the pull, then the NIXL metrics."""

    def __init__(self, registry: KVRegistry, faults: Faults, metrics: SimMetrics, profile: Profile) -> None:
        self._registry = registry
        self._faults = faults
        self._metrics = metrics
        self._profile = profile
        self._bytes_per_token = profile.kv_bytes_per_token
        self._heartbeats: set[asyncio.Task[None]] = set()  # in flight; kept so they are not collected

    async def pull(self, remote: RemoteKV) -> bool:
        start = time.perf_counter()
        self._handshake(remote)
        if self._faults.draw_pull_failure():
            raise KVPullError(f"injected pull failure for {remote.request_id}")
        holder = self._registry.holder(remote.engine_id)
        if holder is not None:
            held = holder.serve_pull(remote.request_id)
        else:
            held = await self._pull_http(remote)
        # Decode reads the blocks its params name, whether or not the holder still holds them; the
        # engine sleeps the profile's pull time after this returns; the histogram is of the whole read.
        seconds = time.perf_counter() - start + self._profile.pull_seconds(len(remote.block_ids))
        self._metrics.nixl_xfer_time.observe(seconds)
        self._metrics.nixl_bytes.observe(float(remote.num_tokens * self._bytes_per_token))
        # Blocks of another prompt read "successfully", as NIXL's do: decode computes on wrong KV.
        is_theirs = held.prompt_digest in (0, remote.prompt_digest) or not remote.prompt_digest
        return held.is_intact and is_theirs

    def _handshake(self, remote: RemoteKV) -> None:
        """vLLM's decode pairs its TP with prefill's at the NIXL handshake, before any read; a pair it
        cannot map fails the handshake, and with it every request that pulls from that prefill."""
        profile = self._profile
        try:
            pair_tp(remote.tp_size, profile.tensor_parallel_size, profile.kv_shape)
        except ConfigError as exc:
            raise KVPullError(f"NIXL handshake with {remote.engine_id} failed: {exc}") from None

    def heartbeat(self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]) -> None:
        holder = self._registry.holder(engine_id)
        if holder is not None:
            holder.heartbeat(request_ids)
            return
        task = asyncio.get_running_loop().create_task(
            self._heartbeat_http(engine_id, host, port, request_ids)
        )
        self._heartbeats.add(task)
        task.add_done_callback(self._heartbeats.discard)

    async def _heartbeat_http(
        self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]
    ) -> None:
        url = f"http://{host}:{port}{HEARTBEAT_PATH}"
        body = orjson.dumps({"remote_engine_id": engine_id, "remote_request_ids": list(request_ids)})
        try:
            async with self._registry.session().post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.debug("heartbeat to %s failed: %r", url, exc)

    async def _pull_http(self, remote: RemoteKV) -> HeldKV:
        url = f"http://{remote.host}:{remote.port}{PULL_PATH}"
        body = orjson.dumps({"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id})
        try:
            async with self._registry.session().post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                payload = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise KVPullError(f"cannot reach KV holder {remote.engine_id} at {url}: {exc!r}") from exc
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise KVPullError(f"KV holder at {url} answered {status} with non-JSON") from exc
        if status != 200:
            error = data.get("error") if isinstance(data, dict) else None
            message = (
                error.get("message") if isinstance(error, dict) else payload[:200].decode(errors="replace")
            )
            raise KVPullError(f"KV holder at {url} answered {status}: {message}")
        return held_from_mapping(data)
