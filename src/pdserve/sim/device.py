"""One GPU that several simulated engines share, as two vLLM processes share a GPU in the article's demo.

Without MPS a GPU runs one process's kernels at a time and time-slices between processes that both have
work queued; a process whose queue runs dry hands the GPU over at once. SharedDevice gives each step
turns of at most ``turn_s`` of device time, first come first served, and takes a step's end to empty its
engine's queue (the next step asks anew, behind any step already waiting): a step shorter than a turn
runs whole; a longer one runs in turns, alternating with the other engine's waiting steps.

Two measurements on one H200 (BENCHMARKS.md "The GPU's own share: two processes on one H200"):

- benchmarks/gpu_share.py (torch only, benchmarks/data/h200-2026-12-04-gpu-share.json): a decode-like
  CUDA graph of 5.0 ms beside back-to-back 178 ms GEMM steps. Decode synced each step: every step took
  12.2 ms (p10-p90 12.14-12.22), prefill's 312; decode queued two deep: steps of 10.1 and 12.7 ms in
  turn (mean 11.2), prefill's 340. No decode step beside a prefill kept its speed. Slices of about 2 ms
  (decode's process) and 2.5 ms (prefill's) explain both phases: queued, 10.0 / 12.5 ms; synced, the
  prefill slice under way less decode's 0.4 ms gap, then 5 ms of decode with two prefill slices between,
  12.1 ms. Turns of 8 ms fit the synced phase (7.6 + 5 ms) but not the queued one, where every other step
  would run clear in 5 ms.
- vLLM 0.26 with CUDA graphs, 1P1D on one H200, the load step (benchmarks/data/h200-2026-12-04-one-gpu.json):
  decode's ITL p50 6.3 ms, p90 13.5, mean 8.9. Most steps kept their speed because prefill was idle
  while they ran (the closed loop's prefills come in bursts), not because the GPU favoured them; a step
  beside a prefill took about 13 ms, as above.

One turn for every step, fitted to both: TURN_S = 2.4 ms. The 5 ms step beside gpu_share's prefill then
takes 11.8 ms and the prefill step 301 ms (measured 12.2 and 312: switching contexts costs the GPU about
3 %, which the model leaves out); the load step's 1P1D gives ITL p50 6.14 / p90 13.05 / mean 9.25 ms and
TTFT mean 640 ms (vLLM: 6.30 / 13.55 / 8.88 and 635). Left out: the measured slices differ by half a
millisecond between the two processes (the device does not know which engine is which), and vLLM's async
scheduling may keep decode's next step queued rather than emptying its queue each step, which in
gpu_share shortened an overlapped step by a millisecond. A step's count of turns moves in jumps with the
turn (a 5.6 ms decode step takes three turns from 1.87 to 2.8 ms), and the load step's ITL p50 sits on the
edge between steps that ran clear and steps that waited: turns of 2.0-2.3 ms put it on the upper mode
(10.6-11.7 ms) at an unchanged mean. Two colocated instances read the same at any turn from 0.5 to 8 ms.

An engine without a device (the default) has a GPU of its own.
"""

from __future__ import annotations

import asyncio

from pdserve.errors import ConfigError
from pdserve.sim.clock import Clock

# Fitted to gpu_share's steps and vLLM's ITL on one H200 (see above). Not the driver's documented slice,
# which NVIDIA does not publish for data-centre GPUs.
TURN_S = 0.0024
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
