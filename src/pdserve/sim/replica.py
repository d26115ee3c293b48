"""One simulated vLLM instance: its engine, role, identity, faults and metrics, as the HTTP layer sees it.

``host`` and ``port`` are what the instance advertises in ``kv_transfer_params`` (``remote_host``,
``remote_port``): where a decoder in another process can reach ``/sim/kv/pull``. The port is known
before the instance is built because the server binds its socket first.

``restart`` is the process dying and coming back as vLLM's does under `pdserve up`'s supervisor: every
connection in flight is cut, nothing answers for a while, then a fresh engine (empty cache, counters from
zero) serves under a NEW engine id, so a decode holding the old kv_transfer_params fails its read at once.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import KVPullError
from pdserve.sim.engine import SimEngine
from pdserve.sim.faults import Faults, FaultSpec
from pdserve.sim.profile import Profile
from pdserve.sim.transfer import KVRegistry, PullSource
from pdserve.sim.types import HeldKV, KVSource, SimRole
from pdserve.sim.vllm_metrics import SimMetrics

# The vLLM release whose HTTP behaviour the sim reproduces (see docs/vllm.md).
VLLM_VERSION = "0.32.0"

EngineFactory = Callable[[Profile, SimRole, str, KVSource], SimEngine]


def _default_engine(profile: Profile, role: SimRole, engine_id: str, kv_source: KVSource) -> SimEngine:
    return SimEngine(profile, role, engine_id, kv_source=kv_source)


@dataclass(eq=False)
class SimInstance:
    role: SimRole
    engine_id: str
    host: str  # advertised as remote_host
    port: int  # advertised as remote_port: this instance's HTTP port
    profile: Profile
    engine: SimEngine
    faults: Faults
    metrics: SimMetrics
    registry: KVRegistry
    engine_factory: EngineFactory = _default_engine
    is_restarting: bool = False  # between the "crash" and the new engine's start: unreachable

    @classmethod
    def create(
        cls,
        profile: Profile,
        role: SimRole,
        host: str,
        port: int,
        registry: KVRegistry,
        faults: FaultSpec | None = None,
        engine_id: str | None = None,
        engine_factory: EngineFactory = _default_engine,
    ) -> SimInstance:
        engine_id = engine_id or str(uuid.uuid4())
        fault_state = Faults(faults)
        metrics = SimMetrics(profile.served_model_name)
        source = PullSource(registry, fault_state, metrics, profile)
        engine = engine_factory(profile, role, engine_id, source)
        return cls(
            role, engine_id, host, port, profile, engine, fault_state, metrics, registry, engine_factory
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.profile.served_model_name

    @property
    def system_fingerprint(self) -> str:
        # vLLM's shape (``vllm-<version>-<8 hex>``); the hex names the profile rather than a build.
        return f"vllm-{VLLM_VERSION}-{zlib.crc32(f'pdserve-sim:{self.profile.name}'.encode()):08x}"

    @property
    def is_reachable(self) -> bool:
        return not (self.faults.is_down or self.is_restarting)

    def serve_pull(self, request_id: str) -> HeldKV:
        """A decoder reads held KV; an instance that is "down" is unreachable, so the read fails."""
        if not self.is_reachable:
            raise KVPullError(f"KV holder {self.engine_id} is down")
        return self.engine.serve_pull(request_id)

    def heartbeat(self, request_ids: tuple[str, ...]) -> None:
        if self.is_reachable:
            self.engine.heartbeat(request_ids)

    async def restart(self, down_s: float, new_engine_id: str) -> None:
        """Die now, and after ``down_s`` come back as a fresh engine named ``new_engine_id``."""
        self.is_restarting = True
        try:
            self.registry.unregister(self.engine_id)
            await self.engine.stop()  # requests in flight end; generation.py cuts their connections
            await asyncio.sleep(down_s)
            self.metrics = SimMetrics(self.profile.served_model_name)
            source = PullSource(self.registry, self.faults, self.metrics, self.profile)
            self.engine = self.engine_factory(self.profile, self.role, new_engine_id, source)
            self.engine_id = new_engine_id
            await self.start()
        finally:
            self.is_restarting = False

    async def start(self) -> None:
        await self.engine.start()
        self.registry.register(self.engine_id, self)

    async def stop(self) -> None:
        self.registry.unregister(self.engine_id)
        await self.engine.stop()
