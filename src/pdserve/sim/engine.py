"""A simulated vLLM engine: the scheduler driven through time, one ``step()`` at a time.

Each step takes the scheduler's plan, lets the profile's step time pass on the clock, then hands each
request the tokens the step produced. Time is a ``Clock`` (clock.py) so tests can run on
``VirtualClock``, where a step of 30 ms costs no wall time and every duration is exact.

Delivery is a deque plus a one-shot future per request rather than an ``asyncio.Queue``: the step loop is
on every token, and in zero-cost mode the proxy's throughput benchmarks measure this path.

Leases, as vLLM 0.32's NixlConnector keeps them (the bookkeeping is leases.py): prefill holds a finished
request's KV until a decode's read is reported or its lease runs out, and reaps expired leases only at a
step, logging vLLM's ``Releasing expired KV blocks ...`` line; an engine holding KV steps all the time,
so that is on time unless it is stalled. A read of blocks no longer held "succeeds" with whatever they
hold now (that request's answer is wrong), and prefill logs ``Potentially invalid KV blocks ...`` when
it reads the notification, which for an engine holding nothing else is at its next request.
``stall(seconds)`` stops the step loop as SIGSTOP of vLLM's EngineCore does: no steps, no reaping, no
heartbeats; reads of its held KV are still served (the NIXL agent is not the engine core).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pdserve.errors import EngineStoppedError, KVPullError
from pdserve.events import EXPIRED_LINE, LATE_PULL_LINE
from pdserve.sim.clock import Clock, LoopClock, sleep_unless_set
from pdserve.sim.clock import VirtualClock as VirtualClock  # tests and the cluster simulator take it here
from pdserve.sim.device import SharedDevice
from pdserve.sim.leases import HolderLeases, Notification, ReaderLeases
from pdserve.sim.profile import Profile
from pdserve.sim.scheduler import PullJob, Scheduler, StepOutput
from pdserve.sim.types import HeldKV, KVSource, SimRequest, SimRole, TokenEvent

log = logging.getLogger("pdserve.sim")

# vLLM heartbeats at every step when lease // 6 is 0; an idle sim decode wakes this often instead.
_MIN_IDLE_HEARTBEAT_S = 0.1
_STALE = HeldKV((), 0, 0.0, 0, is_intact=False)


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # vllm:num_requests_running
    num_waiting: int  # vllm:num_requests_waiting (queued, or pulling remote KV)
    kv_usage: float  # vllm:kv_cache_usage_perc, 0..1; held KV counts
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_kv_expired: int  # held KV freed because its lease ran out before a decode pulled it
    num_notifications_after_expiry: int  # reads of KV no longer held, handled (prefill side)
    num_stale_reads: int  # requests computed on released KV: late pulls, or stale prefix hits (decode)
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
        device: SharedDevice | None = None,
    ) -> None:
        self.profile = profile
        self.role = role
        self.engine_id = engine_id
        self.kv_source = kv_source
        self.clock: Clock = clock if clock is not None else LoopClock()
        self.device = device  # a GPU shared with other engines (device.py); None: one of its own
        self.scheduler = Scheduler(profile, role, vocab_size)
        self.num_pulls_ok = 0
        self.num_pulls_failed = 0
        self._streams: dict[str, _Stream] = {}
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._holder = HolderLeases(profile.kv_lease_s)  # decodes' notifications about KV held here
        self._reader = ReaderLeases(profile.kv_lease_s)  # remote holds this engine keeps alive
        self._stalled_until = -math.inf
        self._wake = asyncio.Event()
        self._frontend = asyncio.Lock()
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

    def stall(self, seconds: float) -> None:
        """Stop stepping for ``seconds`` from now (from the end of the step under way), as SIGSTOP of
        vLLM's EngineCore does; a stall already longer is kept."""
        self._stalled_until = max(self._stalled_until, self.clock.now() + seconds)

    @property
    def is_stalled(self) -> bool:
        return self.clock.now() < self._stalled_until

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (vLLM's dev-mode POST /reset_prefix_cache); hashes forgotten."""
        return self.scheduler.kv.reset_prefix_cache()

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
        if self.profile.frontend_per_request_s:
            # The API server's own work on a request (parsing, building it): one request at a time, so
            # a burst of requests reaches the scheduler spread out, as a burst reaches vLLM's.
            async with self._frontend:
                await self.clock.sleep(self.profile.frontend_per_request_s)
        self.scheduler.add_request(req, self.clock.now())
        if req.remote is not None:
            self._reader.add(request_id, req.remote)
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
            self._reader.done(request_id)
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not is_finished:
                self._abort(request_id)

    def serve_pull(self, request_id: str) -> HeldKV:
        """A remote decode reads the KV of ``request_id``. Held: what it holds, released at this
        engine's next step. Not held (lease run out, read before, never here): ``is_intact`` False, and
        the read is reported as vLLM reports a notification after expiry, at the next step."""
        held = self.scheduler.held.get(request_id)
        self._notify(("read", (request_id,)))
        return held if held is not None else _STALE

    def release_unsent(self, request_id: str) -> None:
        """The KV of ``request_id`` will not be handed over (its prefill ended on a stop string): freed
        now, as vLLM's scheduler frees a request the connector does not delay, not at a later step."""
        self.scheduler.release_held(request_id)

    def heartbeat(self, request_ids: tuple[str, ...]) -> None:
        """A decode still means to read these requests' KV: extend their leases at the next step."""
        if self.scheduler.held:  # ids not held are ignored anyway
            self._notify(("heartbeat", request_ids))

    def _notify(self, notification: Notification) -> None:
        self._holder.notify(notification)
        # An engine holding KV steps continuously (vLLM), so it reads notifications at once; one holding
        # nothing reads them when its next request makes it step.
        if self.scheduler.held:
            self._wake.set()

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
            num_notifications_after_expiry=self._holder.num_late_reads,
            num_stale_reads=s.num_stale_reads,
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
        admit_until = math.inf  # requests that arrived after this wait for the step after next
        try:
            while True:
                start = clock.now()
                if start < self._stalled_until:
                    await clock.sleep(self._stalled_until - start)
                    continue
                if self._holder.has_mail:  # before reaping, as vLLM's worker does
                    self._read_notifications(start)
                if scheduler.held:
                    self._expire_leases()
                if not self._reader.is_empty:
                    self._send_heartbeats(start)
                plan = scheduler.schedule(admit_until)
                for job in plan.pulls:
                    self._pulls[job.request_id] = asyncio.create_task(self._pull(job))
                if not plan.has_compute:
                    if admit_until != math.inf:  # no step in flight now: what arrived is scheduled at once
                        admit_until = math.inf
                        continue
                    await self._idle()
                    continue
                # vLLM's async scheduling plans the next step as this one starts (profile.py)
                admit_until = start if profile.async_scheduling else math.inf
                seconds = profile.step_seconds(
                    plan.num_prefill_tokens, len(plan.decodes), plan.num_decode_ctx_tokens
                )
                if seconds > 0:
                    # Planning took real time on LoopClock; the step as a whole should take `seconds`.
                    alone = max(0.0, start + seconds - clock.now())
                    await (self.device.run(alone) if self.device is not None else clock.sleep(alone))
                else:
                    await asyncio.sleep(0)  # zero-cost: still let consumers and new requests in
                self._deliver(scheduler.update(plan, clock.now()))
        except Exception:
            log.exception("sim engine %s: step loop failed", self.engine_id)
            self._fail_streams(f"engine {self.engine_id} failed; see its log")
            raise

    async def _idle(self) -> None:
        """Sleep until new work, freed blocks, a pull or a notification arrive, the next lease runs out,
        or the next heartbeat is due."""
        self._wake.clear()
        wake_at = self.scheduler.next_expiry()
        due = self._reader.next_due(_MIN_IDLE_HEARTBEAT_S)
        if due is not None:
            wake_at = due if wake_at is None else min(wake_at, due)
        if wake_at is None:
            await self._wake.wait()
            return
        await sleep_unless_set(self.clock, max(0.0, wake_at - self.clock.now()), self._wake)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        streams = self._streams
        for request_id, event in outputs:
            stream = streams.get(request_id)
            if stream is not None:
                stream.events.append(event)
                stream.wake()

    def _expire_leases(self) -> None:
        for request_id in self.scheduler.expire_held(self.clock.now()):
            # vLLM's line (nixl/base_worker.py); the sim releases a hold once read, so never read here.
            log.warning("%s%s which were retrieved by 0 remote worker(s) before lease expired.",
                        EXPIRED_LINE, request_id)  # fmt: skip

    def _read_notifications(self, now: float) -> None:
        for request_id in self._holder.read(self.scheduler, now):
            log.error("%s%s were retrieved by a decode worker. They may have expired.",
                      LATE_PULL_LINE, request_id)  # fmt: skip

    def _send_heartbeats(self, now: float) -> None:
        if self.kv_source is not None:
            for engine_id, host, port, request_ids in self._reader.due(now):
                self.kv_source.heartbeat(engine_id, host, port, request_ids)

    async def _pull(self, job: PullJob) -> None:
        assert self.kv_source is not None  # check_request made sure
        is_intact = True
        try:
            is_intact = await self.kv_source.pull(job.remote)
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
        self._reader.done(job.request_id)  # vLLM stops heartbeating at the read's end
        if is_ok:
            if self.scheduler.mark_pulled(job.request_id, is_intact):
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
