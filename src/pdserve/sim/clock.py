"""Time for the simulated engine: the event loop's own, or a virtual clock for exact, instant tests."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


async def sleep_unless_set(clock: Clock, seconds: float, event: asyncio.Event) -> None:
    """Return after ``seconds`` on ``clock``, or as soon as ``event`` is set if that comes first."""
    woken = asyncio.ensure_future(event.wait())
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait((woken, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
        timer.cancel()


class LoopClock:
    """The running event loop's monotonic time."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class VirtualClock:
    """Time that jumps to the next sleeper's wake-up whenever the event loop has nothing else to run.

    For in-process tests only: waiting on real I/O or real timers counts as idle, so time may jump then.
    Idleness is read from the default asyncio loop's ready queue; on loops without one (uvloop) the clock
    falls back to yielding a fixed number of times, which is usually but not always enough.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()  # equal wake-ups resume in the order they slept
        self._driver: asyncio.Task[None] | None = None

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), wake))
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive(), name="virtual-clock")
        await wake

    async def _drive(self) -> None:
        sleepers = self._sleepers
        while self._has_sleepers():
            await self._settle()
            if not self._has_sleepers():
                return
            self._now = max(self._now, sleepers[0][0])
            while sleepers and sleepers[0][0] <= self._now:
                wake = heapq.heappop(sleepers)[2]
                if not wake.done():
                    wake.set_result(None)

    def _has_sleepers(self) -> bool:
        sleepers = self._sleepers
        while sleepers and sleepers[0][2].done():  # cancelled sleeps
            heapq.heappop(sleepers)
        return bool(sleepers)

    async def _settle(self) -> None:
        ready = getattr(asyncio.get_running_loop(), "_ready", None)
        if ready is None:
            for _ in range(100):
                await asyncio.sleep(0)
            return
        await asyncio.sleep(0)
        # A driver whose sleepers were all cancelled leaves at once: another clock's driver may be
        # settling too (the next test's), and two drivers waiting for an empty ready queue would keep it
        # full for each other forever.
        while ready and self._has_sleepers():
            await asyncio.sleep(0)
