"""One GPU that several simulated engines share, as two vLLM processes share a GPU in the article's demo.

Without MPS a GPU runs one process's kernels at a time and switches between processes that both have work
queued (time-slicing), so each engine's step stretches while the other one is stepping too. SharedDevice
models that as processor sharing: while n steps are on the device each advances at 1/n of its own speed,
and a step that has the device to itself runs at full speed. Measured on one H200 (BENCHMARKS.md "GPU (one
H200)"): 1P1D on one GPU against 1P1D on two, decode's steps took 1.6x and prefill's 1.8x as long.

An engine without a device (the default) has a GPU of its own.
"""

from __future__ import annotations

import asyncio

from pdserve.sim.clock import Clock, sleep_unless_set

_DONE_S = 1e-9  # work left below this is float noise of the subtractions, not work


class SharedDevice:
    """Runs steps of given seconds of work (what each would take alone) on one device, shared fairly."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._left: dict[object, float] = {}  # each running step: seconds of its own work still to do
        self._since = 0.0  # when _left was last brought up to date
        self._changed = asyncio.Event()  # set when a step joins or leaves (shares change); then replaced

    @property
    def num_running(self) -> int:
        return len(self._left)

    async def run(self, work_s: float) -> None:
        """Return when a step of ``work_s`` seconds alone has had that much device time."""
        if work_s <= 0:
            await asyncio.sleep(0)
            return
        step = object()
        self._account()
        self._left[step] = work_s
        self._signal()
        try:
            while self._left[step] > _DONE_S:
                # At the current share this step ends in left * n seconds, unless the share changes first.
                await sleep_unless_set(self._clock, self._left[step] * len(self._left), self._changed)
                self._account()
        finally:
            self._account()
            del self._left[step]
            self._signal()

    def _account(self) -> None:
        """Charge every running step its share of the time since the last change."""
        now = self._clock.now()
        if self._left:
            share = (now - self._since) / len(self._left)
            for step in self._left:
                self._left[step] -= share
        self._since = now

    def _signal(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()
