"""A simulated cluster on a virtual clock: the simulator's engines, PD or colocated, under Poisson load.

What `pdserve plan --check` (and the planner's proof in the tests) measures a plan with. The engines
are the simulator's own (sim/engine.py: the scheduler, KV pool, step-time model and pull time of the
profile) without HTTP and proxy in between, on ``VirtualClock``: a minute of traffic costs a second or
two of CPU and the same seed gives the same numbers on any machine. PD: each request prefills on a
prefill engine (one token, KV held), then decodes on a decode engine that pulls the KV; colocated: one
engine of role "both" serves it whole. Both pools are taken round robin, as the proxy's default.
Goodput is vLLM's: requests that met every SLO per second of the run.

``replay`` runs a time-varying trace (bench/trace.py: phases, bursts) against a fixed layout, taken round
robin as above, or against an elastic pool: N engines of role "both" (each serves whole requests, holds
KV for a remote decode and pulls one) placed per request by the proxy's own ``ElasticRouter``
(proxy/pool/elastic.py), behind its own ``Hold`` (proxy/pool/holding.py), on the virtual clock, so what is
measured is the code that serves.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.load import percentile
from pdserve.bench.trace import Arrival, Served, TraceRun, Traffic
from pdserve.configparts import ElasticPool
from pdserve.errors import ConfigError
from pdserve.proxy.pool.elastic import ElasticRouter, Measured, Placement
from pdserve.proxy.pool.holding import Hold
from pdserve.proxy.pool.routing import Load
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile
from pdserve.sim.types import RemoteKV, SimRequest, SimRole
from pdserve.slo import Slo


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
    on_prefilled: Callable[[], None] | None = None,
) -> list[float]:
    """Request ``i`` as pdserve's proxy serves it: prefilled on ``prefill`` (one token, KV held) and
    pulled by ``decode``, or whole on ``decode`` when ``prefill`` is None; the clock at each token.
    ``on_prefilled`` is called when the prefill has returned."""
    remote = None
    if prefill is not None:
        held = None
        async for event in prefill.generate(SimRequest(f"p{i}", prompt, 1, hold_for_remote=True)):
            held = event.held
        assert held is not None
        if on_prefilled is not None:
            on_prefilled()
        remote = RemoteKV(prefill.engine_id, f"p{i}", held.block_ids, held.num_tokens, "sim", 0)
    return [
        clock.now()
        async for _event in decode.generate(SimRequest(f"r{i}", prompt, output_len, remote=remote))
    ]


class _Engines:
    """A cluster's engines on one virtual clock, each the KV source of the others."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.clock = VirtualClock()
        self.pulls = _Pulls()

    def add(self, role: SimRole, name: str) -> SimEngine:
        e = SimEngine(self.profile, role, name, kv_source=self.pulls, clock=self.clock)
        self.pulls.holders[name] = e
        return e

    def fixed(self, num_prefill: int, num_decode: int) -> tuple[list[SimEngine], list[SimEngine]]:
        """Prefill and decode engines (``num_decode`` of role "both" when ``num_prefill`` is 0)."""
        prefills = [self.add("prefill", f"p{i}") for i in range(num_prefill)]
        decode_role: SimRole = "decode" if num_prefill else "both"
        return prefills, [self.add(decode_role, f"d{i}") for i in range(num_decode)]

    async def start(self) -> None:
        for e in self.pulls.holders.values():
            await e.start()

    async def stop(self) -> None:
        for e in self.pulls.holders.values():
            await e.stop()


async def simulate(profile: Profile, load: ClusterLoad) -> ClusterRun:
    """``load`` on ``profile``'s engines; both pools taken round robin."""
    cluster = _Engines(profile)
    clock = cluster.clock
    prefills, decodes = cluster.fixed(load.num_prefill, load.num_decode)
    await cluster.start()
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
    await cluster.stop()
    return ClusterRun(load, tuple(timings), duration)


def run(profile: Profile, load: ClusterLoad) -> ClusterRun:
    """``simulate`` on a fresh event loop (the default asyncio loop: VirtualClock reads its ready queue)."""
    return asyncio.run(simulate(profile, load))


@dataclass(frozen=True)
class Fixed:
    """A fixed layout for ``replay``: ``num_prefill`` 0 is ``num_decode`` colocated instances."""

    num_prefill: int
    num_decode: int

    def describe(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D" if self.num_prefill else f"{self.num_decode} coloc"


@dataclass(frozen=True)
class Elastic:
    """An elastic pool for ``replay``: ``num_instances`` engines placed by an ``ElasticRouter`` (its
    layout pinned when ``settings.num_prefill`` is set)."""

    num_instances: int
    settings: ElasticPool

    def describe(self) -> str:
        x = self.settings.num_prefill
        if x is None:
            return "elastic"
        return (Fixed(x, self.num_instances - x).describe() if x else "coloc") + "+hold"


class _Member:
    """A simulated engine as the router sees a pool member (what the proxy's Instance exposes)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.num_in_flight = 0

    @property
    def url(self) -> str:
        return self.engine.engine_id

    @property
    def load(self) -> Load:
        s = self.engine.scheduler
        return Load(float(s.num_running), float(s.num_waiting), s.kv.usage)


async def replay(profile: Profile, trace: Traffic, arm: Fixed | Elastic, seed: int = 0) -> TraceRun:
    """Every request of ``trace`` (its arrivals drawn with ``seed``) on ``arm``; waits for the last."""
    cluster = _Engines(profile)
    clock = cluster.clock
    router: ElasticRouter | None = None
    if isinstance(arm, Elastic):
        router = ElasticRouter(arm.settings, clock.now)
        hold = Hold(router, arm.settings.hold_max_s, arm.settings.slo.ttft_ms, clock.now, clock.sleep)
        members = [_Member(cluster.add("both", f"e{i}")) for i in range(arm.num_instances)]
    else:
        prefills, decodes = cluster.fixed(arm.num_prefill, arm.num_decode)
        next_prefill, next_decode = itertools.cycle(prefills or [None]), itertools.cycle(decodes)
    await cluster.start()
    arrivals = trace.arrivals(seed)
    # Prompts that share no block (the first token differs): no prefix-cache hit flatters any arm.
    filler = tuple(range(100, 100 + max((a.input_len for a in arrivals), default=1)))
    served: list[Served] = []

    async def one(a: Arrival) -> None:
        start = clock.now()
        prompt = (1_000_000 + a.index, *filler[: a.input_len - 1])
        placement: Placement[_Member] | None = None
        held = 0.0
        prefilled: Callable[[], None] | None = None
        if router is not None:
            placement, held = await hold.place(lambda: members, a.input_len, a.output_len)
            used = [m for m in (placement.prefill, placement.decode) if m is not None]
            for m in used:
                m.num_in_flight += 1
            prefill = placement.prefill.engine if placement.prefill else None
            decode = placement.decode.engine

            def on_prefilled() -> None:
                assert router is not None and placement is not None and placement.prefill is not None
                placement.prefill.num_in_flight -= 1
                router.prefilled(placement, a.input_len)

            prefilled = on_prefilled
        else:
            prefill, decode = next(next_prefill), next(next_decode)
        times = await serve(a.index, prompt, a.output_len, prefill, decode, clock, prefilled)
        first, last = (times[0], times[-1]) if times else (math.nan, math.nan)
        ttft, tpot = first - start, (last - first) / (a.output_len - 1)
        if router is not None and placement is not None:
            placement.decode.num_in_flight -= 1
            hold.done(placement, Measured(ttft - held, tpot) if times else None)  # placed to first token
        served.append(Served(a.phase, ttft, tpot, prefill is not None))

    tasks = []
    for a in arrivals:
        await clock.sleep(max(0.0, a.at - clock.now()))
        tasks.append(asyncio.ensure_future(one(a)))
    await asyncio.gather(*tasks)
    await cluster.stop()
    return TraceRun(arm.describe(), trace, tuple(sorted(served, key=lambda s: s.phase)))


def run_trace(profile: Profile, trace: Traffic, arm: Fixed | Elastic, seed: int = 0) -> TraceRun:
    """``replay`` on a fresh event loop, with the CPU time it took."""
    began = time.process_time()
    result = asyncio.run(replay(profile, trace, arm, seed))
    return TraceRun(result.arm, result.trace, result.served, time.process_time() - began)
