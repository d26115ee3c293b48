"""The simulated engine through time: step timing, PD hold/pull/lease, aborts and zero-cost throughput.

Timing tests run on a VirtualClock, so durations are exact and cost no wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import pytest

from pdserve.errors import EngineStoppedError, KVPullError
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile
from pdserve.sim.scheduler import NO_TOKEN, StepPlan
from pdserve.sim.types import RemoteKV, SimRequest, SimRole, TokenEvent

TIMED = Profile(
    name="timed",
    step_base_s=0.01,
    prefill_per_token_s=1e-4,
    decode_per_seq_s=1e-3,
    decode_per_ctx_token_s=1e-5,
    kv_pull_base_s=0.002,
    kv_pull_per_block_s=1e-4,
    num_blocks=1024,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    max_model_len=4096,
    kv_lease_s=5.0,
)


def prompt(n: int, first: int = 0) -> tuple[int, ...]:
    return tuple(range(first, first + n))


@contextlib.asynccontextmanager
async def running(*engines: SimEngine) -> AsyncIterator[None]:
    for engine in engines:
        await engine.start()
    try:
        yield
    finally:
        for engine in engines:
            await engine.stop()


async def timed_events(engine: SimEngine, req: SimRequest) -> list[tuple[float, TokenEvent]]:
    return [(engine.clock.now(), event) async for event in engine.generate(req)]


def itls(timed: list[tuple[float, TokenEvent]]) -> list[float]:
    return [b[0] - a[0] for a, b in itertools.pairwise(timed)]


class EngineSource:
    """Pulls straight from in-process prefill engines, as the HTTP layer's in-process source would."""

    def __init__(self, *engines: SimEngine) -> None:
        self.engines = {e.engine_id: e for e in engines}

    async def pull(self, remote: RemoteKV) -> bool:
        holder = self.engines.get(remote.engine_id)
        if holder is None:
            raise KVPullError(f"no engine {remote.engine_id}")
        return holder.serve_pull(remote.request_id).is_intact

    def heartbeat(self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]) -> None:
        if engine_id in self.engines:
            self.engines[engine_id].heartbeat(request_ids)


class FailingSource:
    async def pull(self, remote: RemoteKV) -> bool:
        raise KVPullError("injected fault")

    def heartbeat(self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]) -> None:
        pass


class StuckSource:
    async def pull(self, remote: RemoteKV) -> bool:
        await asyncio.Event().wait()
        return True

    def heartbeat(self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]) -> None:
        pass


def remote_of(engine: SimEngine, request_id: str, event: TokenEvent) -> RemoteKV:
    assert event.held is not None
    return RemoteKV(engine.engine_id, request_id, event.held.block_ids, event.held.num_tokens, "127.0.0.1", 0)


# --- Step time model ---------------------------------------------------------------------------------


async def test_virtual_clock_wakes_sleepers_in_time_order_at_exact_times() -> None:
    clock = VirtualClock()
    woke: list[tuple[str, float]] = []

    async def nap(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    await asyncio.gather(nap("slow", 3.0), nap("fast", 0.5), nap("mid", 1.25))
    assert woke == [("fast", 0.5), ("mid", 1.25), ("slow", 3.0)]


async def test_lone_request_ttft_is_its_prefill_steps() -> None:
    engine = SimEngine(TIMED, "both", "e", clock=VirtualClock())
    async with running(engine):
        timed = await timed_events(engine, SimRequest("a", prompt(1000), 3))
    # Two chunks (512 + 488 tokens), each step paying the base cost.
    assert timed[0][0] == pytest.approx(2 * 0.01 + 1000 * 1e-4, abs=1e-9)
    assert timed[0][1].num_cached_tokens == 0


async def test_itl_rises_with_batch_size_and_context() -> None:
    async def decode_itls(num_requests: int, prompt_len: int) -> list[float]:
        engine = SimEngine(TIMED, "both", "e", clock=VirtualClock())
        async with running(engine):
            runs = await asyncio.gather(
                *(timed_events(engine, SimRequest(f"r{i}", prompt(prompt_len, 10_000 * i), 8))
                  for i in range(num_requests))
            )  # fmt: skip
        return itls(runs[0])

    alone, batch, long = await decode_itls(1, 16), await decode_itls(8, 16), await decode_itls(1, 2000)
    # First decode step: context = prompt + 1 token.
    assert alone[0] == pytest.approx(0.01 + 1e-3 + 17 * 1e-5, abs=1e-9)
    assert batch[0] == pytest.approx(0.01 + 8 * 1e-3 + 8 * 17 * 1e-5, abs=1e-9)
    assert long[0] == pytest.approx(0.01 + 1e-3 + 2001 * 1e-5, abs=1e-9)
    assert alone[1] > alone[0]  # each token lengthens the context


@pytest.mark.parametrize(("role", "interferes"), [("both", True), ("decode", False)])
async def test_long_prefill_slows_decoding_only_where_it_is_computed(role: SimRole, interferes: bool) -> None:
    clock = VirtualClock()
    prefill = SimEngine(TIMED, "prefill", "p", clock=clock)
    engine = SimEngine(TIMED, role, "e", kv_source=EngineSource(prefill), clock=clock)
    async with running(prefill, engine):
        decoding = asyncio.create_task(timed_events(engine, SimRequest("a", prompt(16), 40)))
        await clock.sleep(0.1)
        long = SimRequest("b", prompt(4000, 50_000), 1)
        if role == "decode":  # PD: the prompt is computed elsewhere and only pulled here
            [(_, held)] = await timed_events(prefill, SimRequest("b", long.prompt_token_ids, 1, True))
            long = SimRequest("b", long.prompt_token_ids, 1, remote=remote_of(prefill, "b", held))
        await timed_events(engine, long)
        gaps = itls(await decoding)
    biggest_jump = max(b - a for a, b in itertools.pairwise(gaps))
    if interferes:
        assert biggest_jump > 500 * 1e-4  # a ~511-token chunk rode along in a decode step
    else:
        assert biggest_jump < 2e-4  # only the last prompt token is computed here


# --- PD: hold, pull, lease ---------------------------------------------------------------------------


async def test_held_kv_counts_in_usage_until_its_lease_expires() -> None:
    clock = VirtualClock()
    prefill = SimEngine(TIMED, "prefill", "p", clock=clock)
    async with running(prefill):
        [(done_at, event)] = await timed_events(
            prefill, SimRequest("r", prompt(40), 100, hold_for_remote=True)
        )
        assert event.finish_reason == "length" and event.held is not None
        assert event.held.expires_at == pytest.approx(done_at + TIMED.kv_lease_s)
        stats = prefill.stats
        assert (stats.num_held, stats.kv_usage) == (1, 3 / TIMED.num_blocks)
        await clock.sleep(TIMED.kv_lease_s + 0.5)
        stats = prefill.stats
        assert (stats.num_held, stats.kv_usage, stats.num_kv_expired) == (0, 0.0, 1)
        # vLLM's read of released (or never held) blocks does not fail: it gets whatever they hold.
        assert not prefill.serve_pull("r").is_intact
        assert not prefill.serve_pull("never-seen").is_intact


async def test_decode_pulls_held_kv_and_continues_the_same_token_stream() -> None:
    clock = VirtualClock()
    prefill = SimEngine(TIMED, "prefill", "p", clock=clock)
    decode = SimEngine(TIMED, "decode", "d", kv_source=EngineSource(prefill), clock=clock)
    colocated = SimEngine(TIMED, "both", "c", clock=clock)
    ids = prompt(100)
    async with running(prefill, decode, colocated):
        [(_, first)] = await timed_events(prefill, SimRequest("r", ids, 5, hold_for_remote=True))
        start = clock.now()
        timed = await timed_events(decode, SimRequest("r", ids, 5, remote=remote_of(prefill, "r", first)))
        expected = [e.token_id async for e in colocated.generate(SimRequest("x", ids, 5))]
    assert [e.token_id for _, e in timed] == expected
    assert first.token_id == expected[0]
    # The pull (7 blocks), then one step computing just the last prompt token.
    pull_s, step_s = 0.002 + 7 * 1e-4, 0.01 + 1e-4
    assert timed[0][0] - start == pytest.approx(pull_s + step_s, abs=1e-9)
    # vLLM reports every prompt token the connector loaded as cached, the recomputed last one too.
    assert timed[0][1].num_cached_tokens == 100
    stats = decode.stats
    assert (stats.num_pulls_ok, stats.prompt_tokens_remote, stats.prompt_tokens_computed) == (1, 99, 1)
    assert (prefill.stats.num_held, prefill.stats.kv_usage) == (0, 0.0)
    assert not prefill.serve_pull("r").is_intact  # one read per hold: the blocks went back


async def test_failed_pull_ends_the_request_with_an_error_and_frees_its_blocks() -> None:
    decode = SimEngine(TIMED, "decode", "d", kv_source=FailingSource(), clock=VirtualClock())
    remote = RemoteKV("p", "r", (0, 1), 20, "127.0.0.1", 0)
    async with running(decode):
        events = [e async for e in decode.generate(SimRequest("r", prompt(20), 5, remote=remote))]
    assert [(e.token_id, e.finish_reason) for e in events] == [(NO_TOKEN, "error")]
    stats = decode.stats
    assert (stats.num_pulls_failed, stats.kv_usage, stats.num_waiting) == (1, 0.0, 0)


async def test_pull_after_the_lease_expired_succeeds_with_wrong_tokens() -> None:
    clock = VirtualClock()
    prefill = SimEngine(TIMED, "prefill", "p", clock=clock)
    decode = SimEngine(TIMED, "decode", "d", kv_source=EngineSource(prefill), clock=clock)
    colocated = SimEngine(TIMED, "both", "c", clock=clock)
    async with running(prefill, decode, colocated):
        [(_, held)] = await timed_events(prefill, SimRequest("r", prompt(30), 1, hold_for_remote=True))
        await clock.sleep(TIMED.kv_lease_s + 1)
        req = SimRequest("r", prompt(30), 4, remote=remote_of(prefill, "r", held))
        events = [e async for e in decode.generate(req)]
        expected = [e.token_id async for e in colocated.generate(SimRequest("x", prompt(30), 4))]
    assert [e.finish_reason for e in events] == [None, None, None, "length"]
    assert [e.token_id for e in events] != expected
    stats = decode.stats
    assert (stats.num_pulls_ok, stats.num_pulls_failed, stats.num_stale_reads) == (1, 0, 1)
    assert prefill.stats.num_kv_expired == 1


# --- Aborts, capacity, lifecycle ---------------------------------------------------------------------


async def test_closing_the_stream_aborts_the_request_and_frees_its_blocks_at_once() -> None:
    engine = SimEngine(TIMED, "both", "e", clock=VirtualClock())
    async with running(engine):
        stream = engine.generate(SimRequest("r", prompt(64), 1000))
        async for event in stream:
            if event.index == 2:
                break
        assert engine.stats.kv_usage > 0
        await stream.aclose()
        assert (engine.stats.kv_usage, engine.stats.num_running) == (0.0, 0)


async def test_cancelling_the_consumer_aborts_a_request_waiting_for_its_pull() -> None:
    engine = SimEngine(TIMED, "decode", "d", kv_source=StuckSource(), clock=VirtualClock())
    remote = RemoteKV("p", "r", (0,), 10, "127.0.0.1", 0)
    async with running(engine):
        consumer = asyncio.create_task(timed_events(engine, SimRequest("r", prompt(10), 5, remote=remote)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert (engine.stats.num_waiting, engine.stats.kv_usage) == (1, 1 / TIMED.num_blocks)
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        assert (engine.stats.num_waiting, engine.stats.kv_usage) == (0, 0.0)


async def test_requests_beyond_capacity_queue_and_preemption_keeps_the_tokens() -> None:
    tight = Profile(block_size=4, num_blocks=12, max_num_seqs=3, max_model_len=64)
    roomy, small = SimEngine(Profile(), "both", "r"), SimEngine(tight, "both", "s")
    reqs = [SimRequest(f"q{i}", prompt(10, 100 * i), 20) for i in range(6)]

    async def all_tokens(engine: SimEngine) -> list[list[int]]:
        async def one(req: SimRequest) -> list[int]:
            return [e.token_id async for e in engine.generate(req)]

        return list(await asyncio.gather(*(one(r) for r in reqs)))

    async with running(roomy, small):
        assert await all_tokens(small) == await all_tokens(roomy)
    assert small.stats.num_preemptions > 0 and roomy.stats.num_preemptions == 0


async def test_stopping_the_engine_ends_open_streams_with_an_error() -> None:
    engine = SimEngine(TIMED, "both", "e", clock=VirtualClock())
    with pytest.raises(EngineStoppedError, match="not running"):
        await anext(engine.generate(SimRequest("r", prompt(4), 1)))
    await engine.start()
    stream = engine.generate(SimRequest("r", prompt(4), 1000))
    await anext(stream)
    await engine.stop()
    with pytest.raises(EngineStoppedError, match="stopped"):
        async for _ in stream:
            pass
    assert engine.stats.kv_usage == 0.0


async def test_invalid_requests_fail_before_any_token() -> None:
    engine = SimEngine(TIMED, "decode", "d")
    async with running(engine):
        with pytest.raises(ValueError, match="maximum context length"):
            await anext(engine.generate(SimRequest("r", prompt(4000), 200)))
        with pytest.raises(ValueError, match="no KV source"):
            await anext(
                engine.generate(SimRequest("r", prompt(4), 1, remote=RemoteKV("p", "r", (), 4, "h", 1)))
            )
        assert engine.stats.num_waiting == 0


async def test_idle_engine_does_not_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = SimEngine(Profile(), "both", "e")
    schedule = engine.scheduler.schedule
    num_plans = 0

    def counted(admit_until: float) -> StepPlan:
        nonlocal num_plans
        num_plans += 1
        return schedule(admit_until)

    monkeypatch.setattr(engine.scheduler, "schedule", counted)
    async with running(engine):
        [_ async for _ in engine.generate(SimRequest("r", prompt(4), 3))]
        before = num_plans
        await asyncio.sleep(0.02)
        assert num_plans == before


# --- Throughput --------------------------------------------------------------------------------------


async def test_zero_cost_engine_streams_every_token_of_64_concurrent_requests() -> None:
    engine = SimEngine(Profile(), "both", "e")

    async def consume(req: SimRequest) -> int:
        return sum([1 async for _ in engine.generate(req)])

    reqs = [SimRequest(f"r{i}", prompt(64, 1000 * i), 256) for i in range(64)]
    async with running(engine):
        num_tokens = sum(await asyncio.gather(*(consume(r) for r in reqs)))
    assert num_tokens == 64 * 256  # how fast: benchmarks/sim_throughput.py


async def test_async_scheduling_makes_a_request_arriving_mid_step_wait_one_step_more() -> None:
    """vLLM's async scheduling plans step k+1 as step k starts: a request that arrives during step k is
    first computed in step k+2, one step later than with the plan made when step k ends."""

    async def second_ttft(async_scheduling: bool) -> float:
        profile = Profile(step_base_s=0.01, max_num_batched_tokens=512, async_scheduling=async_scheduling)
        clock = VirtualClock()
        engine = SimEngine(profile, "both", "e", clock=clock)
        async with running(engine):

            async def late() -> float:
                await clock.sleep(0.005)  # mid-way through the first request's first step
                return (await timed_events(engine, SimRequest("b", prompt(4, 100), 1)))[0][0] - 0.005

            first = asyncio.ensure_future(timed_events(engine, SimRequest("a", prompt(4), 20)))
            ttft = await late()
            await first
        return ttft

    assert await second_ttft(False) == pytest.approx(0.015)  # the rest of step 1, then step 2
    assert await second_ttft(True) == pytest.approx(0.025)  # step 2 was planned without it


async def test_a_burst_reaches_the_scheduler_spread_out_by_the_api_servers_turn_per_request() -> None:
    profile = Profile(step_base_s=0.01, frontend_per_request_s=0.002, max_num_batched_tokens=512)
    clock = VirtualClock()
    engine = SimEngine(profile, "both", "e", clock=clock)
    async with running(engine):
        firsts = await asyncio.gather(
            *(timed_events(engine, SimRequest(f"r{i}", prompt(4, 10 * i), 1)) for i in range(3))
        )
    # r0 alone in the step starting at 2 ms; r1 (at 4 ms) and r2 (at 6 ms) in the next, from 12 ms
    assert [events[0][0] for events in firsts] == [
        pytest.approx(0.012),
        pytest.approx(0.022),
        pytest.approx(0.022),
    ]
