"""SharedDevice: engines sharing one GPU take turns of it, and only while both have a step to run."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from pdserve.errors import ConfigError
from pdserve.sim.device import TURN_S, SharedDevice
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.profile import Profile
from pdserve.sim.types import SimRequest


async def _finish_times(
    clock: VirtualClock, device: SharedDevice, steps: list[tuple[float, float]]
) -> list[float]:
    """Run (start at, seconds of work) steps on the device; when each ended."""

    async def one(at: float, work: float) -> float:
        await clock.sleep(at)
        await device.run(work)
        return clock.now()

    return list(await asyncio.gather(*(one(at, work) for at, work in steps)))


async def test_a_step_alone_on_the_device_takes_its_own_time() -> None:
    clock = VirtualClock()
    assert await _finish_times(clock, SharedDevice(clock), [(0.0, 1.0)]) == [pytest.approx(1.0)]


async def test_two_long_steps_started_together_take_turns_and_the_first_ends_a_turn_earlier() -> None:
    clock = VirtualClock()
    ends = await _finish_times(clock, SharedDevice(clock, turn_s=0.25), [(0.0, 1.0), (0.0, 1.0)])
    assert ends == [pytest.approx(1.75), pytest.approx(2.0)]


async def test_a_short_step_waits_out_the_turn_under_way_then_runs_whole() -> None:
    clock = VirtualClock()
    # The long step's turn under way at 0.6 ends at 0.75; the short one runs 0.75-0.85 unbroken, and the
    # long one, 1.25 s of work left, ends 0.1 s later than alone.
    ends = await _finish_times(clock, SharedDevice(clock, turn_s=0.25), [(0.0, 2.0), (0.6, 0.1)])
    assert ends == [pytest.approx(2.1), pytest.approx(0.85)]


async def test_short_steps_beside_a_long_one_mostly_keep_their_speed() -> None:
    # vLLM's decode on one GPU with a prefill (BENCHMARKS.md): a step shorter than a turn either runs
    # alone or waits one turn of the prefill, never crawls at half speed the whole time.
    clock = VirtualClock()
    device = SharedDevice(clock, turn_s=0.008)
    durations: list[float] = []

    async def decode() -> None:
        for _ in range(40):
            start = clock.now()
            await device.run(0.005)
            durations.append(clock.now() - start)

    async def prefill() -> None:
        await clock.sleep(0.05)
        await device.run(0.1)

    await asyncio.gather(decode(), prefill())
    assert all(0.005 - 1e-9 <= d <= 0.005 + 0.008 + 1e-9 for d in durations)  # at most one turn's wait
    assert sum(d == pytest.approx(0.005) for d in durations) > len(durations) / 2


async def test_the_device_is_free_again_once_its_steps_end() -> None:
    clock = VirtualClock()
    device = SharedDevice(clock)
    await _finish_times(clock, device, [(0.0, 1.0), (0.0, 1.0)])
    assert not device.is_busy
    start = clock.now()
    await device.run(0.25)
    assert clock.now() - start == pytest.approx(0.25)


async def test_steps_waiting_together_take_turns_in_the_order_they_asked() -> None:
    clock = VirtualClock()
    ends = await _finish_times(clock, SharedDevice(clock, turn_s=0.25), [(0.0, 1.0), (0.0, 1.0), (0.0, 1.0)])
    # a, b, c, a, b, c, ...: each has had 0.75 s when the fourth round begins at 2.25
    assert ends == [pytest.approx(2.5), pytest.approx(2.75), pytest.approx(3.0)]


async def test_a_step_that_asks_later_waits_behind_those_already_waiting() -> None:
    clock = VirtualClock()
    # The long step's turn ends at 0.25; the short steps, waiting since 0.1 and 0.2, run before its next.
    ends = await _finish_times(clock, SharedDevice(clock, turn_s=0.25), [(0.0, 1.0), (0.1, 0.1), (0.2, 0.1)])
    assert ends == [pytest.approx(1.2), pytest.approx(0.35), pytest.approx(0.45)]


async def _gpu_share(device: SharedDevice, clock: VirtualClock) -> tuple[list[float], list[float]]:
    """benchmarks/gpu_share.py's "both, decode synced" phase: 5 ms decode steps 0.37 ms apart beside
    178 ms prefill steps 2 ms apart, for 3 s; each one's duration."""
    decode: list[float] = []
    prefill: list[float] = []

    async def loop(work: float, gap: float, out: list[float]) -> None:
        while clock.now() < 3.0:
            start = clock.now()
            await device.run(work)
            out.append(clock.now() - start)
            await clock.sleep(gap)

    await asyncio.gather(loop(0.005, 0.00037, decode), loop(0.178, 0.002, prefill))
    return decode, prefill


async def test_the_fitted_turn_stretches_gpu_shares_steps_as_the_h200_did() -> None:
    clock = VirtualClock()
    decode, prefill = await _gpu_share(SharedDevice(clock), clock)
    # A decode step waits out the prefill turn under way, then runs its three turns with two of prefill's
    # between (all but those in prefill's 2 ms gaps): 12.2 ms on the H200 (p10-p90 12.14-12.22), prefill's
    # 312 (switching contexts, not modelled, is the rest). No step runs clear at 5 ms.
    expected = TURN_S - 0.00037 + 0.005 + 2 * TURN_S
    assert sum(d == pytest.approx(expected) for d in decode) > 0.9 * len(decode)
    assert min(decode) > 0.005 + TURN_S
    assert expected == pytest.approx(0.01218, rel=0.05)
    assert statistics.median(prefill) == pytest.approx(0.312, rel=0.05)


async def test_the_same_steps_on_the_same_device_end_at_the_same_times() -> None:
    async def once() -> list[float]:
        clock = VirtualClock()
        rng = random.Random(7)
        steps = [(rng.uniform(0, 0.05), rng.uniform(0.001, 0.02)) for _ in range(30)]
        return await _finish_times(clock, SharedDevice(clock), steps)

    assert await once() == await once()


def test_a_turn_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="turn must be positive"):
        SharedDevice(VirtualClock(), turn_s=0.0)


async def test_two_engines_on_one_device_decode_slower_than_on_devices_of_their_own() -> None:
    profile = Profile(step_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0, request_overhead_s=0.0)

    async def decode_time(shared: bool) -> float:
        clock = VirtualClock()
        device = SharedDevice(clock) if shared else None
        engines = [SimEngine(profile, "both", f"e{i}", clock=clock, device=device) for i in range(2)]
        for e in engines:
            await e.start()

        async def serve(e: SimEngine) -> None:
            async for _ in e.generate(SimRequest(f"r-{e.engine_id}", (1, 2, 3), 10)):
                pass

        await asyncio.gather(*(serve(e) for e in engines))
        for e in engines:
            await e.stop()
        return clock.now()

    alone, shared = await decode_time(False), await decode_time(True)
    assert shared == pytest.approx(2 * alone, rel=0.15)
