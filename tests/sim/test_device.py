"""SharedDevice: engines sharing one GPU stretch each other's steps, and only while both step."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.sim.device import SharedDevice
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


async def test_two_steps_started_together_share_the_device_and_end_together() -> None:
    clock = VirtualClock()
    assert await _finish_times(clock, SharedDevice(clock), [(0.0, 1.0), (0.0, 1.0)]) == [
        pytest.approx(2.0),
        pytest.approx(2.0),
    ]


async def test_a_short_step_arriving_mid_way_slows_the_long_one_only_while_it_runs() -> None:
    clock = VirtualClock()
    # The long step has 1.5 s left at 0.5; both run at half speed until the short one ends at 1.5 (its
    # 0.5 s took 1 s), then the long one has 1.0 s left and the device to itself: it ends at 2.5.
    ends = await _finish_times(clock, SharedDevice(clock), [(0.0, 2.0), (0.5, 0.5)])
    assert ends == [pytest.approx(2.5), pytest.approx(1.5)]


async def test_the_device_is_free_again_once_its_steps_end() -> None:
    clock = VirtualClock()
    device = SharedDevice(clock)
    await _finish_times(clock, device, [(0.0, 1.0), (0.0, 1.0)])
    assert device.num_running == 0
    start = clock.now()
    await device.run(0.25)
    assert clock.now() - start == pytest.approx(0.25)


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
