"""The proxy's state and its one owner, ``ProxyState``: the pools of instances, their membership, the
KV ledger, the request counters and the recent traces.

The flow, the health checker, the admin API and the routes call its methods; none of them keeps state
of its own or writes another's fields. Each instance's own lifecycle (health, draining, breaker,
in-flight count) is kept by ``Instance`` (instance.py) and moved only through its methods.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from pdserve.config import INSTANCE_ROLES, ProxyConfig, Role
from pdserve.events import InstanceEvent, KVLogEvent
from pdserve.protocol import Endpoint
from pdserve.proxy.kv.ledger import Ledger
from pdserve.proxy.pool.backpressure import Backpressure
from pdserve.proxy.pool.breaker import CircuitBreaker
from pdserve.proxy.pool.elastic import ElasticRouter
from pdserve.proxy.pool.holding import Hold
from pdserve.proxy.pool.instance import EngineLoad, Instance
from pdserve.proxy.pool.routing import Policy
from pdserve.proxy.pool.warmup import pairs_of, warm
from pdserve.proxy.record.record import Trace
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.record.timeline import Timeline, Timings
from pdserve.proxy.wire.upstream import HTTPUpstream, Upstream

log = logging.getLogger("pdserve.proxy")

_DRAIN_POLL_S = 0.1
_DRAIN_LIMIT_S = 600.0
_REST_GRACE_S = 30.0

UpstreamFactory = Callable[[Role, str], Upstream]


class Outcome(enum.Enum):
    """How a request ended, as /metrics counts it."""

    OK = "ok"
    CLIENT_ERROR = "client_error"  # 4xx: the request itself (bad input, auth, overload)
    ERROR = "error"  # 5xx: an instance or the proxy failed it
    STREAM_ERROR = "stream_error"  # a 200 stream that ended with an error event
    CLIENT_DISCONNECTED = "client_disconnected"

    # Counted per request under (endpoint, outcome): hashed by identity, as members compare, instead of
    # Enum's hash of the name (a Python call each time).
    __hash__ = object.__hash__

    @staticmethod
    def of(out: Responder) -> Outcome:
        """The label a finished request is counted under, from what its client was sent."""
        if not out.finished and out.failure is None:
            return Outcome.CLIENT_DISCONNECTED
        if out.has_error_event or (out.status == 200 and out.failure is not None):
            return Outcome.STREAM_ERROR
        code = out.status or 0
        return Outcome.OK if code == 200 else Outcome.CLIENT_ERROR if code < 500 else Outcome.ERROR


class Pool:
    """The instances of one role, in the order they were added (an elastic pool's take either part)."""

    def __init__(self, role: Role, instances: Iterable[Instance] = ()) -> None:
        self.role = role
        self._instances = list(instances)

    @property
    def instances(self) -> Sequence[Instance]:
        return tuple(self._instances)

    def available(self, exclude: Sequence[Instance] = ()) -> list[Instance]:
        """The instances in service outside ``exclude``; when there are none, those resting (a resting
        instance takes requests only when no other can)."""
        now = time.monotonic()
        found = [i for i in self._instances if i.is_available(now) and i not in exclude]
        return found or [i for i in self._instances if i.is_available(now, True) and i not in exclude]

    def has_available(self, exclude: Sequence[Instance] = (), also: Instance | None = None) -> bool:
        """Whether ``available`` would name one outside ``exclude`` and ``also`` (no list built)."""
        now = time.monotonic()
        for i in self._instances:  # noqa: SIM110 - a loop: cheaper than any() over a generator
            if i is not also and i not in exclude and i.is_available(now, True):
                return True
        return False

    def find(self, url: str) -> Instance | None:
        return next((i for i in self._instances if i.url == url), None)

    def add(self, instance: Instance) -> None:
        self._instances.append(instance)

    def discard(self, instance: Instance) -> None:
        if instance in self._instances:
            self._instances.remove(instance)


class Stats:
    """Request counters (read at scrape time by metrics.py)."""

    def __init__(self) -> None:
        self.outcomes: Counter[tuple[Endpoint, Outcome]] = Counter()
        self.retries: Counter[str] = Counter()  # phase → attempts retried on another instance
        self.panics: Counter[str] = Counter()  # role → requests sent to an out-of-service instance
        self.purges: Counter[str] = Counter()  # result → decode prefix-cache resets after a late pull
        self.releases: Counter[str] = Counter()  # result → prefill blocks released after decode refused
        self.num_stand_ins = 0  # requests a prefill instance served whole: no decode was in service
        self.migrations: Counter[str] = Counter()  # result → streams continued after decode failed
        self.warmups: Counter[str] = Counter()  # result → returning instances' handshake warm-ups
        self.timings = Timings()

    def finished(self, endpoint: Endpoint, outcome: Outcome) -> None:
        self.outcomes[(endpoint, outcome)] += 1

    def retried(self, phase: str) -> None:
        self.retries[phase] += 1

    def panicked(self, role: str) -> None:
        self.panics[role] += 1

    def purged(self, result: str) -> None:
        self.purges[result] += 1

    def migrated(self, result: str) -> None:
        self.migrations[result] += 1

    def stood_in(self) -> None:
        self.num_stand_ins += 1

    def released(self, result: str) -> None:
        self.releases[result] += 1

    def warmed_up(self, result: str) -> None:
        self.warmups[result] += 1

    def timed(self, timeline: Timeline) -> None:
        self.timings.observe(timeline)


class ProxyState:
    def __init__(
        self,
        config: ProxyConfig,
        policies: dict[Role, Policy],
        make_upstream: UpstreamFactory | None = None,
        num_traces: int = 256,
        share_stranded: Callable[[str], None] | None = None,
    ) -> None:
        self._config = config
        # Another proxy worker's decodes are this one's too: each stranded push is told to them all.
        self._share_stranded = share_stranded
        self._policies = policies
        self._make_upstream = make_upstream or self._http_upstream
        # A pool per role the config fronts; ``pool(role)`` is the one that takes that role's part: an
        # elastic pool takes both, and its router (proxy/pool/elastic.py) decides per request which
        # member plays which. A part no pool takes (a colocated proxy's prefill) has an empty pool.
        own = {spec.role: Pool(spec.role) for spec in config.pools}
        self._pools = {role: own.get(role) or own.get("elastic") or Pool(role) for role in INSTANCE_ROLES}
        for spec in config.pools:
            for url in spec.urls:
                own[spec.role].add(self.new_instance(spec.role, url))
        self.elastic = ElasticRouter(config.elastic_pool) if "elastic" in own else None
        pool = config.elastic_pool
        self.hold = None if self.elastic is None else Hold(self.elastic, pool.hold_max_s, pool.slo.ttft_ms)
        self.ledger = Ledger(config.kv_lease_s)
        # prefill only what a decode will keep alive until it pulls; the rest waits here (backpressure.py)
        self.backpressure = Backpressure(config.kv_lease_s, config.admission.max_decode_wait_s,
                                         scrape_every_s=config.health.interval_s)  # fmt: skip
        self.stats = Stats()
        self._traces: deque[Trace] = deque(maxlen=num_traces)
        # The loop the proxy serves on, from ``open`` to ``close``: asyncio.get_running_loop() costs a
        # getpid() syscall on CPython 3.11, and a request would ask it more than once.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # removals and warm-ups: close() cancels them

    def _http_upstream(self, role: Role, url: str) -> Upstream:
        return HTTPUpstream(
            role, url, self._config.timeouts.connect, self._config.max_connections_per_upstream
        )

    # --- reading ----------------------------------------------------------------------------------

    def policy(self, role: Role) -> Policy:
        return self._policies[role]

    def pool(self, role: Role) -> Pool:
        return self._pools[role]

    @property
    def pools(self) -> list[Pool]:
        """Each pool once (an elastic pool takes both parts), in plan order (prefill first)."""
        return list({id(pool): pool for pool in self._pools.values()}.values())

    @property
    def instances(self) -> list[Instance]:
        return [i for pool in self.pools for i in pool.instances]

    def by_name(self) -> dict[str, Instance]:
        """Each instance under its pool name, as `pdserve up` and /instances' order give it: prefill-0,
        decode-1, elastic-0."""
        return {
            f"{pool.role}-{k}": instance for pool in self.pools for k, instance in enumerate(pool.instances)
        }

    def find(self, url: str) -> Instance | None:
        return next((i for i in self.instances if i.url == url), None)

    def can_serve(self) -> bool:
        """At least one instance of each pool it fronts takes requests now."""
        return all(self._pools[role].available() for role in self._config.roles())

    def describe(self) -> list[dict[str, object]]:
        return [self.describe_instance(i) for i in self.instances]

    def describe_instance(self, instance: Instance) -> dict[str, object]:
        """``Instance.describe`` with what the pool knows of it: the KV it holds for decodes, whether a
        drain is complete, and in an elastic pool the side it leans to and, on the decode side, the
        requests it runs and the most the hold lets it run now (``decode_batch``)."""
        about = {**instance.describe(), "kv_held": self.ledger.num_held_at(instance.url),
                 "drained": instance.is_draining and self.is_drained(instance)}  # fmt: skip
        if self.elastic is not None:
            about["side"] = self.elastic.side(instance.url)
            about["decode_batch"] = self.elastic.batch(instance.url)
        return about

    @property
    def traces(self) -> Sequence[Trace]:
        return tuple(self._traces)

    def record(self, trace: Trace) -> None:
        self._traces.append(trace)

    # --- lifecycle --------------------------------------------------------------------------------

    def new_instance(self, role: Role, url: str) -> Instance:
        """An instance not yet in any pool, of the pool that takes ``role``'s part (an elastic pool's for
        either): the admin API checks its model before ``add``."""
        config = self._config
        breaker = CircuitBreaker(config.health.breaker_threshold, config.health.breaker_cooldown_s)
        upstream = self._make_upstream(self._pools[role].role, url)
        # A resting decode needs the supervisor's idle time: the registration watchdog (the lease), its
        # checks' interval and a restart's first event.
        rest_idle_limit_s = config.kv_lease_s + _REST_GRACE_S
        return Instance(upstream, breaker, config.health.unhealthy_after_checks,
                        config.health.rest_after_stranded_pushes, rest_idle_limit_s)  # fmt: skip

    async def open(self) -> None:
        self.loop = asyncio.get_running_loop()
        for instance in self.instances:
            await instance.upstream.open()

    async def close(self) -> None:
        self.loop = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(i.upstream.close() for i in self.instances))

    def add(self, instance: Instance) -> None:
        """Put an opened instance into service."""
        self._pools[instance.role].add(instance)
        log.info("added %s instance %s", self.kind_of(instance), instance.url)

    def drain(self, instance: Instance) -> None:
        """Take no new requests there; the in-flight ones finish."""
        instance.start_draining()
        log.info(
            "draining %s instance %s (%d in flight)",
            self.kind_of(instance),
            instance.url,
            instance.num_in_flight,
        )

    def push_stranded(self, instance: Instance, from_peer: bool = False) -> None:
        """A push ``instance`` may have registered blocks for will never come (handover.py); a proxy's
        workers all count it (``from_peer``: another worker saw it), so that the decode rests in every
        one of them."""
        instance.push_stranded()
        if self._share_stranded is not None and not from_peer:
            self._share_stranded(instance.url)

    def remove(self, instance: Instance) -> None:
        """Drain, then drop the instance once nothing is in flight there (bounded) and close it."""
        self.drain(instance)
        self.forget_cache(instance)
        task = asyncio.create_task(self._remove_when_idle(instance))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def is_drained(self, instance: Instance) -> bool:
        """Nothing left there: no request in flight and no KV held for a decode still to pull it
        (stopping the process sooner would fail those requests' pulls)."""
        return not instance.num_in_flight and not self.ledger.num_held_at(instance.url)

    async def _remove_when_idle(self, instance: Instance) -> None:
        waited = 0.0
        while not self.is_drained(instance) and waited < _DRAIN_LIMIT_S:
            await asyncio.sleep(_DRAIN_POLL_S)
            waited += _DRAIN_POLL_S
        instance.mark_removed()
        self._pools[instance.role].discard(instance)
        if self.elastic is not None:
            self.elastic.forget(instance.url)
        if self.hold is not None:
            self.hold.wake()
        await instance.upstream.close()
        log.info("removed %s instance %s", self.kind_of(instance), instance.url)

    def on_event(self, event: InstanceEvent | KVLogEvent) -> None:
        """What the launcher learnt (stack.py delivers it on the proxy's loop)."""
        instance = self.find(event.url)
        if instance is None:
            return
        if isinstance(event, KVLogEvent):
            self.ledger.on_log_event(event)
            return
        if event.kind in ("exited", "restarting"):
            instance.restarting(f"{event.kind}: {event.detail}" if event.detail else event.kind)
        elif event.kind == "ready":
            instance.restarted()
            self.forget_cache(instance)  # a new process: an empty prefix cache
            self._warm_up(instance)
        elif event.kind == "gave_up":
            instance.gave_up(f"not restarted: {event.detail}")
        elif event.kind == "moved":
            self._move(instance, event.new_url)
        log.warning("%s instance %s: %s %s", self.kind_of(instance), instance.url, event.kind, event.detail)

    def kind_of(self, instance: Instance) -> str:
        """The instance's role as its operator named it (logs, /metrics): its pool's."""
        return instance.role

    def _move(self, instance: Instance, new_url: str) -> None:
        """The instance serves at ``new_url`` now (Ray restarted it on another node): a fresh instance
        there takes its place in the pool, and the old one leaves once idle."""
        if self.find(new_url) is not None:
            return
        moved = self.new_instance(instance.role, new_url)

        async def replace() -> None:
            await moved.upstream.open()
            self.add(moved)
            self.remove(instance)

        task = asyncio.create_task(replace())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def check_passed(self, instance: Instance, load: EngineLoad | None) -> None:
        was_down = instance.was_unreachable
        if instance.check_passed(load):
            # Back from unhealthy: it may have restarted, and a restarted engine's prefix cache is
            # empty, whatever the proxy remembers having sent there. If it was down (not merely
            # stalled), it is a new process that its peers have not met.
            self.forget_cache(instance)
            if was_down:
                self._warm_up(instance)

    def check_failed(self, instance: Instance, error: str, unreachable: bool = False) -> None:
        instance.check_failed(error, unreachable)

    def _warm_up(self, instance: Instance) -> None:
        """Out of service while a canary per pair meets its peers (warmup.py), then in."""
        timeout_s = self._config.health.warmup_timeout_s
        if timeout_s <= 0 or not self._config.can_split:
            return  # no pool prefills for another: nothing moves between instances, nothing to meet
        # Its peers: the pool of the part it hands KV to or takes it from; an elastic pool's, its own.
        role = instance.role
        other: Role = "decode" if role == "prefill" else "prefill" if role == "decode" else role
        pairs = pairs_of(instance, self._pools[other].available(), role == "elastic")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # told outside the proxy's loop (a test's state alone): nothing could send canaries
        if not pairs:
            return  # no peer in service to meet: the first handoff will do it
        key = self._config.api_keys.upstream
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        instance.warming()

        async def run() -> None:
            started = time.monotonic()
            try:
                errors = await warm(pairs, headers, timeout_s)
            finally:
                instance.warmed()
            self.stats.warmed_up("failed" if errors else "ok")
            took = time.monotonic() - started
            if errors:
                log.warning("%s instance %s serves after its warm-up failed (%.1f s): %s",
                            self.kind_of(instance), instance.url, took, "; ".join(errors))  # fmt: skip
            else:
                log.info("%s instance %s met %d peer pair(s) in %.2f s; in service",
                         self.kind_of(instance), instance.url, len(pairs), took)  # fmt: skip

        task = loop.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget_cache(self, instance: Instance) -> None:
        for policy in self._policies.values():
            policy.forget(instance.url)
