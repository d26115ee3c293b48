"""One GPU that several simulated engines share, as two vLLM processes share a GPU in the article's demo.

Without MPS a GPU runs one process's kernels at a time. While another process has work queued, the one on
the GPU keeps it for at most a time slice; a process whose queue runs dry hands it over at once. The model
takes vLLM's queue to run dry at each step's end (the CPU reads the sampled tokens before the next step
goes out; the H200's ITL below fits that, benchmarks/gpu_share.py is there to measure it), so SharedDevice
gives each step turns of at most ``turn_s`` of device time, first come first served: a step shorter than a
turn runs whole, and the other engine's waiting step goes next; a longer one runs in turns, alternating
with the other engine's steps.

Against the H200 (BENCHMARKS.md "CUDA graphs on one and two H200s"): 1P1D on one GPU, where a prefill step of
6,400 tokens (150 ms alone) meets decode steps of 5.6 ms, decode's ITL was 6.3 ms at p50 and 13.5 at p90:
most steps ran whole, and one in three waited for a prefill turn of about 8 ms. Processor sharing (every
overlapped step at half speed) gets the same mean but a p50 of 11 ms; turns of 8 ms give 6.1 and 13.9.
Two colocated instances, whose steps are shorter than a turn, alternate step by step either way.

An engine without a device (the default) has a GPU of its own.
"""

from __future__ import annotations

import asyncio

from pdserve.errors import ConfigError
from pdserve.sim.clock import Clock

# Fitted on one H200 with vLLM 0.26 (see above): decode's ITL p90 less its p50 there. Not the driver's
# documented slice, which NVIDIA does not publish for data-centre GPUs.
TURN_S = 0.008
_DONE_S = 1e-9  # work left below this is float noise of the subtractions, not work


class SharedDevice:
    """Runs steps of given seconds of work (what each would take alone) on one device, by turns."""

    def __init__(self, clock: Clock, turn_s: float = TURN_S) -> None:
        if not turn_s > 0:
            raise ConfigError(f"a shared GPU's turn must be positive seconds, not {turn_s!r}")
        self._clock = clock
        self._turn_s = turn_s
        self._turn = asyncio.Lock()  # FIFO: a step that asks again while another waits goes behind it

    @property
    def is_busy(self) -> bool:
        return self._turn.locked()

    async def run(self, work_s: float) -> None:
        """Return when a step of ``work_s`` seconds alone has had that much device time."""
        if work_s <= 0:
            await asyncio.sleep(0)
            return
        left = work_s
        while left > _DONE_S:
            async with self._turn:
                turn = min(left, self._turn_s)
                await self._clock.sleep(turn)
                left -= turn
