"""A simulated vLLM engine: the scheduler driven through time, one ``step()`` at a time.

Each step takes the scheduler's plan, lets the profile's step time pass on the clock, then hands each
request the tokens the step produced. Time is a ``Clock`` so tests can run on ``VirtualClock``, where a
step of 30 ms costs no wall time and every duration is exact.

Delivery is a deque plus a one-shot future per request rather than an ``asyncio.Queue``: the step loop is
on every token, and in zero-cost mode the proxy's throughput benchmarks measure this path.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from pdserve.errors import EngineStoppedError, KVPullError
from pdserve.sim.profile import Profile
from pdserve.sim.scheduler import PullJob, Scheduler, StepOutput
from pdserve.sim.types import HeldKV, KVSource, SimRequest, SimRole, TokenEvent

log = logging.getLogger("pdserve.sim")

_NUM_EXPIRED_REMEMBERED = 65536  # to tell "lease expired" from "never heard of it" in serve_pull


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


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
        while sleepers:
            await self._settle()
            while sleepers and sleepers[0][2].done():  # cancelled sleeps
                heapq.heappop(sleepers)
            if not sleepers:
                return
            self._now = max(self._now, sleepers[0][0])
            while sleepers and sleepers[0][0] <= self._now:
                wake = heapq.heappop(sleepers)[2]
                if not wake.done():
                    wake.set_result(None)

    @staticmethod
    async def _settle() -> None:
        ready = getattr(asyncio.get_running_loop(), "_ready", None)
        if ready is None:
            for _ in range(100):
                await asyncio.sleep(0)
            return
        await asyncio.sleep(0)
        while ready:
            await asyncio.sleep(0)


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # vllm:num_requests_running
    num_waiting: int  # vllm:num_requests_waiting (queued, or pulling remote KV)
    kv_usage: float  # vllm:kv_cache_usage_perc, 0..1; held KV counts
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_kv_expired: int  # held KV freed because its lease ran out before a decode pulled it
    num_pulls_ok: int  # this engine's pulls of remote KV (decode side)
    num_pulls_failed: int
    prompt_tokens_computed: int  # prefill tokens computed, recomputation after preemption included
    prompt_tokens_cached: int  # served by the local prefix cache
    prompt_tokens_remote: int  # pulled from a prefill engine
    generation_tokens: int
    num_held: int  # requests whose KV is held for a remote decode


class _Stream:
    __slots__ = ("error", "events", "waiter")

    def __init__(self) -> None:
        self.events: deque[TokenEvent] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: EngineStoppedError | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class SimEngine:
    def __init__(
        self,
        profile: Profile,
        role: SimRole,
        engine_id: str,
        kv_source: KVSource | None = None,
        clock: Clock | None = None,
        vocab_size: int = 1000,
    ) -> None:
        self.profile = profile
        self.role = role
        self.engine_id = engine_id
        self.kv_source = kv_source
        self.clock: Clock = clock if clock is not None else LoopClock()
        self.scheduler = Scheduler(profile, role, vocab_size)
        self.num_pulls_ok = 0
        self.num_pulls_failed = 0
        self._streams: dict[str, _Stream] = {}
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- Lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-{self.engine_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        tasks = [*self._pulls.values(), *([task] if task else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_streams(f"engine {self.engine_id} stopped")

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # --- Requests ------------------------------------------------------------------------------------

    def check_request(self, req: SimRequest) -> None:
        """Raise ValueError (vLLM's 400) if ``req`` cannot be served here; ``generate`` checks it too."""
        self.scheduler.check_request(req)
        if req.remote is not None and self.kv_source is None:
            raise ValueError(f"engine {self.engine_id} has no KV source to pull remote KV from")

    async def generate(self, req: SimRequest) -> AsyncGenerator[TokenEvent, None]:
        """The request's tokens as they are produced; the last event has ``finish_reason`` set.

        An "error" event (failed KV pull) carries no token (``token_id`` is ``NO_TOKEN``). Closing the
        generator early (``aclose``, cancellation) aborts the request and frees its blocks at once.
        """
        if not self.is_running:
            raise EngineStoppedError(f"engine {self.engine_id} is not running")
        self.check_request(req)
        loop = asyncio.get_running_loop()
        request_id = req.request_id
        if self.profile.request_overhead_s:
            # vLLM's API server and engine IPC, before the scheduler sees the request: it delays this
            # request's first token but, being another process's work, not other requests' steps.
            await self.clock.sleep(self.profile.request_overhead_s)
        self.scheduler.add_request(req)
        stream = self._streams[request_id] = _Stream()
        self._wake.set()
        is_finished = False
        try:
            while True:
                events = stream.events
                if not events:
                    if stream.error is not None:
                        raise stream.error
                    stream.waiter = loop.create_future()
                    await stream.waiter
                    continue
                event = events.popleft()
                is_finished = event.finish_reason is not None
                yield event
                if is_finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not is_finished:
                self._abort(request_id)

    def serve_pull(self, request_id: str) -> HeldKV:
        """A remote decode reads the KV held for ``request_id``; the hold is released (vLLM frees the
        blocks once the decoder's read completes)."""
        held = self.scheduler.held.get(request_id)
        if held is not None and held.expires_at <= self.clock.now():
            self._expire_leases()
            held = None
        if held is None:
            if request_id in self._expired:
                raise KVPullError(
                    f"KV of request {request_id!r} on engine {self.engine_id} expired "
                    f"(lease {self.profile.kv_lease_s}s)"
                )
            raise KVPullError(f"unknown request {request_id!r} on engine {self.engine_id}: no KV held for it")
        self.scheduler.release_held(request_id)
        self._wake.set()
        return held

    @property
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv.usage,
            prefix_cache_queries=s.kv.prefix_cache_queries,
            prefix_cache_hits=s.kv.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_kv_expired=s.num_kv_expired,
            num_pulls_ok=self.num_pulls_ok,
            num_pulls_failed=self.num_pulls_failed,
            prompt_tokens_computed=s.prompt_tokens_computed,
            prompt_tokens_cached=s.prompt_tokens_cached,
            prompt_tokens_remote=s.prompt_tokens_remote,
            generation_tokens=s.generation_tokens,
            num_held=len(s.held),
        )

    # --- The step loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        scheduler, clock, profile = self.scheduler, self.clock, self.profile
        try:
            while True:
                start = clock.now()
                if scheduler.held:
                    self._expire_leases()
                plan = scheduler.schedule()
                for job in plan.pulls:
                    self._pulls[job.request_id] = asyncio.create_task(self._pull(job))
                if not plan.has_compute:
                    await self._idle()
                    continue
                seconds = profile.step_seconds(
                    plan.num_prefill_tokens, len(plan.decodes), plan.num_decode_ctx_tokens
                )
                if seconds > 0:
                    # Planning took real time on LoopClock; the step as a whole should take `seconds`.
                    await clock.sleep(max(0.0, start + seconds - clock.now()))
                else:
                    await asyncio.sleep(0)  # zero-cost: still let consumers and new requests in
                self._deliver(scheduler.update(plan, clock.now()))
        except Exception:
            log.exception("sim engine %s: step loop failed", self.engine_id)
            self._fail_streams(f"engine {self.engine_id} failed; see its log")
            raise

    async def _idle(self) -> None:
        """Sleep until new work, freed blocks or a pull arrive, or until the next lease runs out."""
        self._wake.clear()
        expiry = self.scheduler.next_expiry()
        if expiry is None:
            await self._wake.wait()
            return
        woken = asyncio.ensure_future(self._wake.wait())
        timer = asyncio.ensure_future(self.clock.sleep(max(0.0, expiry - self.clock.now())))
        try:
            await asyncio.wait((woken, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            timer.cancel()

    def _deliver(self, outputs: list[StepOutput]) -> None:
        streams = self._streams
        for request_id, event in outputs:
            stream = streams.get(request_id)
            if stream is not None:
                stream.events.append(event)
                stream.wake()

    def _expire_leases(self) -> None:
        for request_id in self.scheduler.expire_held(self.clock.now()):
            log.debug("sim engine %s: KV lease of %s expired", self.engine_id, request_id)
            self._expired[request_id] = None
            if len(self._expired) > _NUM_EXPIRED_REMEMBERED:
                self._expired.popitem(last=False)

    async def _pull(self, job: PullJob) -> None:
        assert self.kv_source is not None  # check_request made sure
        try:
            await self.kv_source.pull(job.remote)
            seconds = self.profile.pull_seconds(job.num_blocks)
            if seconds > 0:
                await self.clock.sleep(seconds)
            is_ok = True
        except KVPullError as exc:
            log.info("sim engine %s: KV pull for %s failed: %s", self.engine_id, job.request_id, exc)
            is_ok = False
        except Exception:
            # A broken source must not leave the request waiting forever.
            log.exception("sim engine %s: KV source failed for %s", self.engine_id, job.request_id)
            is_ok = False
        self._pulls.pop(job.request_id, None)
        if is_ok:
            if self.scheduler.mark_pulled(job.request_id):
                self.num_pulls_ok += 1
                self._wake.set()
            return
        output = self.scheduler.mark_pull_failed(job.request_id)
        if output is not None:
            self.num_pulls_failed += 1
            self._deliver([output])

    def _abort(self, request_id: str) -> None:
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            pull.cancel()
        if self.scheduler.abort(request_id):
            self._wake.set()  # the freed blocks may let the waiting queue move

    def _fail_streams(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.error = EngineStoppedError(reason)
            stream.wake()
