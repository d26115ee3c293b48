"""A simulated cluster on a virtual clock: the simulator's engines, PD or colocated, under Poisson load.

What `pdserve plan --check` (and the planner's proof in the tests) measures a plan with. The engines
are the simulator's own (sim/engine.py: the scheduler, KV pool, step-time model and pull time of the
profile) without HTTP and proxy in between, on ``VirtualClock``: a minute of traffic costs a second or
two of CPU and the same seed gives the same numbers on any machine. PD: each request prefills on a
prefill engine (one token, KV held), then decodes on a decode engine that pulls the KV; colocated: one
engine of role "both" serves it whole. Both pools are taken round robin, as the proxy's default.
Goodput is vLLM's: requests that met every SLO per second of the run.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from dataclasses import dataclass

from pdserve.bench.load import percentile
from pdserve.costmodel import Slo
from pdserve.errors import ConfigError
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile
from pdserve.sim.types import RemoteKV, SimRequest, SimRole


@dataclass(frozen=True)
class Timing:
    """One request's latencies on the virtual clock."""

    ttft_s: float
    tpot_s: float
    e2e_s: float


@dataclass(frozen=True)
class ClusterLoad:
    """One simulated run's layout and load: ``num_requests`` Poisson arrivals at ``rate``/s of
    ``input_len`` random tokens, each asking ``output_len`` tokens."""

    num_prefill: int  # 0: colocated
    num_decode: int  # the colocated instances, when colocated
    rate: float
    input_len: int
    output_len: int
    num_requests: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ConfigError(f"a cluster needs num_prefill >= 0 and num_decode >= 1, got {self}")
        if self.rate <= 0 or min(self.input_len, self.output_len, self.num_requests) < 1:
            raise ConfigError(f"rate must be > 0 and the lengths and num_requests >= 1, got {self}")

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode


@dataclass(frozen=True)
class ClusterRun:
    load: ClusterLoad
    timings: tuple[Timing, ...]
    duration_s: float

    @property
    def num_instances(self) -> int:
        return self.load.num_instances

    def goodput(self, slo: Slo) -> float:
        good = sum(1 for t in self.timings if meets(t, slo))
        return good / self.duration_s if self.duration_s > 0 else 0.0

    def goodput_per_instance(self, slo: Slo) -> float:
        return self.goodput(slo) / self.num_instances

    def attainment(self, slo: Slo) -> float:
        return sum(1 for t in self.timings if meets(t, slo)) / len(self.timings) if self.timings else 0.0

    def quantile(self, field: str, q: float) -> float:
        return percentile([getattr(t, field) for t in self.timings], q)


def meets(t: Timing, slo: Slo) -> bool:
    return (
        (slo.ttft_ms is None or t.ttft_s * 1000 <= slo.ttft_ms)
        and (slo.tpot_ms is None or t.tpot_s * 1000 <= slo.tpot_ms)
        and (slo.e2el_ms is None or t.e2e_s * 1000 <= slo.e2el_ms)
    )


class _Pulls:
    """The KV source of every decode engine: straight to the holder's ``serve_pull`` (one process)."""

    def __init__(self) -> None:
        self.holders: dict[str, SimEngine] = {}

    async def pull(self, remote: RemoteKV) -> bool:
        return self.holders[remote.engine_id].serve_pull(remote.request_id).is_intact

    def heartbeat(self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]) -> None:
        self.holders[engine_id].heartbeat(request_ids)


async def serve(
    i: int,
    prompt: tuple[int, ...],
    output_len: int,
    prefill: SimEngine | None,
    decode: SimEngine,
    clock: VirtualClock,
) -> list[float]:
    """Request ``i`` as pdserve's proxy serves it: prefilled on ``prefill`` (one token, KV held) and
    pulled by ``decode``, or whole on ``decode`` when ``prefill`` is None; the clock at each token."""
    remote = None
    if prefill is not None:
        held = None
        async for event in prefill.generate(SimRequest(f"p{i}", prompt, 1, hold_for_remote=True)):
            held = event.held
        assert held is not None
        remote = RemoteKV(prefill.engine_id, f"p{i}", held.block_ids, held.num_tokens, "sim", 0)
    return [
        clock.now()
        async for _event in decode.generate(SimRequest(f"r{i}", prompt, output_len, remote=remote))
    ]


async def simulate(profile: Profile, load: ClusterLoad) -> ClusterRun:
    """``load`` on ``profile``'s engines; both pools taken round robin."""
    clock = VirtualClock()
    pulls = _Pulls()

    def engine(role: SimRole, name: str) -> SimEngine:
        e = SimEngine(profile, role, name, kv_source=pulls, clock=clock)
        pulls.holders[name] = e
        return e

    colocated = load.num_prefill == 0
    prefills = [engine("prefill", f"p{i}") for i in range(load.num_prefill)]
    decodes = [engine("both" if colocated else "decode", f"d{i}") for i in range(load.num_decode)]
    for e in (*prefills, *decodes):
        await e.start()
    rng = random.Random(load.seed)
    next_prefill, next_decode = itertools.cycle(prefills or [None]), itertools.cycle(decodes)
    timings: list[Timing] = []

    async def one(i: int, prompt: tuple[int, ...], prefill: SimEngine | None, decode: SimEngine) -> None:
        start = clock.now()
        times = await serve(i, prompt, load.output_len, prefill, decode, clock)
        first, last = (times[0], times[-1]) if times else (math.nan, math.nan)
        tpot = (last - first) / (load.output_len - 1) if load.output_len > 1 else 0.0
        timings.append(Timing(first - start, tpot, last - start))

    began = clock.now()
    tasks = []
    for i in range(load.num_requests):
        await clock.sleep(rng.expovariate(load.rate))
        # Distinct random prompts: no prefix-cache hit flatters either mode.
        prompt = tuple(rng.randrange(100, 1_000_000) for _ in range(load.input_len))
        tasks.append(asyncio.ensure_future(one(i, prompt, next(next_prefill), next(next_decode))))
    await asyncio.gather(*tasks)
    duration = clock.now() - began
    for e in (*prefills, *decodes):
        await e.stop()
    return ClusterRun(load, tuple(timings), duration)


def run(profile: Profile, load: ClusterLoad) -> ClusterRun:
    """``simulate`` on a fresh event loop (the default asyncio loop: VirtualClock reads its ready queue)."""
    return asyncio.run(simulate(profile, load))
