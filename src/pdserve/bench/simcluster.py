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

from pdserve.bench.workload import Slo
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile
from pdserve.sim.types import RemoteKV, SimRequest, SimRole


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    tpot_s: float
    e2e_s: float


@dataclass(frozen=True)
class ClusterRun:
    num_prefill: int  # 0 when colocated
    num_decode: int  # the colocated instances, when colocated
    rate: float
    timings: tuple[Timing, ...]
    duration_s: float

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode

    def goodput(self, slo: Slo) -> float:
        good = sum(1 for t in self.timings if meets(t, slo))
        return good / self.duration_s if self.duration_s > 0 else 0.0

    def goodput_per_instance(self, slo: Slo) -> float:
        return self.goodput(slo) / self.num_instances

    def attainment(self, slo: Slo) -> float:
        return sum(1 for t in self.timings if meets(t, slo)) / len(self.timings) if self.timings else 0.0

    def quantile(self, field: str, q: float) -> float:
        values = sorted(getattr(t, field) for t in self.timings)
        return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


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


async def simulate(
    profile: Profile,
    num_prefill: int,
    num_decode: int,
    rate: float,
    input_len: int,
    output_len: int,
    num_requests: int = 400,
    seed: int = 0,
) -> ClusterRun:
    """``num_requests`` Poisson arrivals at ``rate``/s; ``num_prefill`` 0 means ``num_decode`` colocated."""
    clock = VirtualClock()
    pulls = _Pulls()

    def engine(role: SimRole, name: str) -> SimEngine:
        e = SimEngine(profile, role, name, kv_source=pulls, clock=clock)
        pulls.holders[name] = e
        return e

    colocated = num_prefill == 0
    prefills = [engine("prefill", f"p{i}") for i in range(num_prefill)]
    decodes = [engine("both" if colocated else "decode", f"d{i}") for i in range(num_decode)]
    for e in (*prefills, *decodes):
        await e.start()
    rng = random.Random(seed)
    next_prefill, next_decode = itertools.cycle(prefills or [None]), itertools.cycle(decodes)
    timings: list[Timing] = []

    async def one(i: int, prompt: tuple[int, ...], prefill: SimEngine | None, decode: SimEngine) -> None:
        start = clock.now()
        remote = None
        if prefill is not None:
            held = None
            async for event in prefill.generate(SimRequest(f"p{i}", prompt, 1, hold_for_remote=True)):
                held = event.held
            assert held is not None
            remote = RemoteKV(prefill.engine_id, f"p{i}", held.block_ids, held.num_tokens, "sim", 0)
        first = last = math.nan
        async for _event in decode.generate(SimRequest(f"r{i}", prompt, output_len, remote=remote)):
            last = clock.now()
            if math.isnan(first):
                first = last
        tpot = (last - first) / (output_len - 1) if output_len > 1 else 0.0
        timings.append(Timing(first - start, tpot, last - start))

    began = clock.now()
    tasks = []
    for i in range(num_requests):
        await clock.sleep(rng.expovariate(rate))
        # Distinct random prompts: no prefix-cache hit flatters either mode.
        prompt = tuple(rng.randrange(100, 1_000_000) for _ in range(input_len))
        tasks.append(asyncio.ensure_future(one(i, prompt, next(next_prefill), next(next_decode))))
    await asyncio.gather(*tasks)
    duration = clock.now() - began
    for e in (*prefills, *decodes):
        await e.stop()
    return ClusterRun(num_prefill, num_decode, rate, tuple(timings), duration)


def run(
    profile: Profile,
    num_prefill: int,
    num_decode: int,
    rate: float,
    input_len: int,
    output_len: int,
    num_requests: int = 400,
    seed: int = 0,
) -> ClusterRun:
    """``simulate`` on a fresh event loop (the default asyncio loop: VirtualClock reads its ready queue)."""
    return asyncio.run(
        simulate(profile, num_prefill, num_decode, rate, input_len, output_len, num_requests, seed)
    )
