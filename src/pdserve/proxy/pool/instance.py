"""One vLLM instance as the proxy sees it: its upstream client, its lifecycle, breaker, load, in-flight.

The lifecycle, and who moves it:

    serving ──3 failed checks (1 if it never answered)──▶ unhealthy ──a passed check──▶ serving
       │                                                                  (reported: it may have restarted)
       ├── the launcher saw it exit ──▶ restarting ──the launcher has it back──▶ serving (breaker reset)
       │                                    └──the launcher gave up──▶ unhealthy
       ├── back (ready, or a passed check after unreachable) ──▶ warming ──its canaries done──▶ serving
       ├── pushes that never came ≥ the limit ──▶ resting ──restarted──▶ serving
       │   (a push decode: no new requests     ├──idle, and its /metrics show no block held──▶ serving
       │    while another can take them)       └──idle past the supervisor's time, not restarted──▶ serving
       └── admin drain / remove ──▶ draining ──in-flight reaches 0 (remove)──▶ removed

Health checks (health.py) report through ``check_passed``/``check_failed``; the launcher (through
``ProxyState.on_event``) through ``restarting``/``restarted``/``gave_up``; requests through
``dispatch``/``undispatch``/``succeeded``/``failed``, which feed the circuit breaker, and ``push_stranded``
(handover.py); the admin API through
``ProxyState`` (state.py), which owns membership; ``ProxyState`` also through ``warming``/``warmed``
around a returning instance's handshake canaries (warmup.py). Nobody else writes these fields.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

from pdserve import prometheus
from pdserve.config import Role
from pdserve.proxy.pool.breaker import CircuitBreaker
from pdserve.proxy.pool.routing import Load
from pdserve.proxy.wire.upstream import Upstream

log = logging.getLogger("pdserve.proxy")


class Lifecycle(enum.Enum):
    SERVING = "serving"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"  # its process exited; the launcher is starting it again
    DRAINING = "draining"  # takes no new requests; in-flight ones finish
    WARMING = "warming"  # back, and meeting its peers (NIXL handshakes) before it takes requests
    # A push decode holding the blocks of pushes that never came: it takes requests only when no other
    # instance of its pool can, so that it goes idle and its supervisor restarts it (engines/stranded.py).
    RESTING = "resting"
    REMOVED = "removed"


@dataclass(frozen=True)
class EngineLoad(Load):
    """What the engine's /metrics said at the last scrape."""

    num_kv_expired: float = 0.0  # prefill: leases that ran out unpulled (vllm:nixl_num_kv_expired_reqs)
    num_tokens: float = 0.0  # prompt and generated tokens the engine processed so far (counters)
    ttft_sum: float = 0.0  # its time to first token, summed and counted (a decode's includes the pull)
    ttft_count: float = 0.0

    @classmethod
    def from_metrics(cls, text: str) -> EngineLoad:
        samples = prometheus.parse_prometheus(text)
        return cls(
            samples.get(prometheus.NUM_RUNNING, 0.0),
            samples.get(prometheus.NUM_WAITING, 0.0),
            samples.get(prometheus.KV_USAGE, 0.0),
            samples.get(prometheus.KV_EXPIRED, 0.0),
            samples.get(prometheus.PROMPT_TOKENS, 0.0) + samples.get(prometheus.GENERATION_TOKENS, 0.0),
            samples.get(prometheus.TTFT_SUM, 0.0),
            samples.get(prometheus.TTFT_COUNT, 0.0),
        )


class Instance:
    def __init__(
        self,
        upstream: Upstream,
        breaker: CircuitBreaker,
        unhealthy_after_checks: int = 3,
        rest_after_stranded: int = 0,
        rest_idle_limit_s: float = 60.0,
    ) -> None:
        self.upstream = upstream
        self.url = upstream.url  # read on every attempt: an attribute, not a property call
        self.breaker = breaker
        # One slow /health from a busy API server must not take a working instance out of service.
        self._unhealthy_after_checks = unhealthy_after_checks
        self._is_healthy = True  # optimistic until the first check: a fresh proxy serves at once
        self._has_answered = False  # a health check has passed at least once
        self._num_failed_checks = 0  # consecutive
        self._is_draining = False
        self._is_removed = False
        self._is_restarting = False
        self._is_warming = False
        self._was_unreachable = False
        self._num_in_flight = 0  # requests this engine owes steps to (the wait for progress: lag_s)
        self._num_early = 0  # decode's requests of pushes sent before prefill answered (hold_early)
        self._load = EngineLoad()
        self._has_load = False  # a /metrics scrape has succeeded (since the last restart)
        self._last_error: str | None = None
        self._awaiting_first: dict[int, float] = {}  # streamed requests with no first byte yet → since
        # The last sign that its engine steps while the proxy has requests there: its token counters
        # moved, or an answer (a stream's first byte, a whole answer) came.
        self._progress_at = time.monotonic()
        # vLLM frees the blocks a push decode registered only when the push arrives (docs/handover.md):
        # after ``rest_after_stranded`` pushes that never came (0: never) it rests, so that it goes idle
        # and its supervisor restarts it. Idle for ``rest_idle_limit_s`` and not restarted, nobody will:
        # it serves again, holding them.
        self._rest_after = rest_after_stranded
        self._rest_idle_limit_s = rest_idle_limit_s
        self._num_stranded = 0  # pushes that may never have come, since its last restart or rest
        self._is_resting = False
        self._idle_since = time.monotonic()  # nothing of this proxy in flight there since
        self._load_at = 0.0  # monotonic: the last scrape of its /metrics

    @property
    def role(self) -> Role:
        return self.upstream.role

    @property
    def lifecycle(self) -> Lifecycle:
        if self._is_removed:
            return Lifecycle.REMOVED
        if self._is_draining:
            return Lifecycle.DRAINING
        if self._is_restarting:
            return Lifecycle.RESTARTING
        if not self._is_healthy:
            return Lifecycle.UNHEALTHY
        if self._is_resting:
            return Lifecycle.RESTING
        return Lifecycle.WARMING if self._is_warming else Lifecycle.SERVING

    def is_available(self, now: float, even_resting: bool = False) -> bool:
        # ``lifecycle is Lifecycle.SERVING``, without building it: asked of each instance per attempt.
        # ``even_resting``: or resting, as a pool with no other instance in service takes it.
        return (
            self._is_healthy
            and not (self._is_removed or self._is_draining or self._is_restarting)
            and (even_resting or not (self._is_resting and self._rests(now)))
            and self.breaker.allows(now)
        )

    @property
    def is_panic_candidate(self) -> bool:
        """Out of service by its health, its circuit or its warm-up, not by intent (draining, removed,
        restarting): a request no instance in service can take goes to one of these."""
        return self.lifecycle in (
            Lifecycle.SERVING,
            Lifecycle.UNHEALTHY,
            Lifecycle.WARMING,
            Lifecycle.RESTING,
        )

    @property
    def failure_score(self) -> tuple[int, int]:
        """Lower is likelier to answer: fewer failed requests in a row, then fewer failed checks."""
        return (self.breaker.num_consecutive_failures, self._num_failed_checks)

    def why_unavailable(self, now: float) -> str:
        lifecycle = self.lifecycle
        if lifecycle is Lifecycle.UNHEALTHY:
            return f"unhealthy: {self._last_error}"
        if lifecycle is not Lifecycle.SERVING:
            return str(lifecycle.value)
        return f"circuit {self.breaker.state(now)}"

    # --- health checks --------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._is_healthy

    @property
    def was_unreachable(self) -> bool:
        """A failed check since the last passed one could not connect: if it answers again, it is a new
        process (its peers have not met it)."""
        return self._was_unreachable

    @property
    def load(self) -> EngineLoad:
        return self._load

    @property
    def num_kv_expired(self) -> float | None:
        """Prefill's count of leases that ran out unpulled at the last scrape; None before one."""
        return self._load.num_kv_expired if self._has_load else None

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def check_passed(self, load: EngineLoad | None) -> bool:
        """A health check passed; True when the instance was unhealthy before (it may have restarted)."""
        if self._is_restarting:
            return False  # the old process's port may still answer a moment; the launcher says when
        recovered = not self._is_healthy
        if recovered and self._was_unreachable:
            self._forget_stranded()  # a new process: the old one's blocks went with it
        self._is_healthy, self._has_answered, self._num_failed_checks = True, True, 0
        self._was_unreachable = False
        self._last_error = None
        if load is not None:
            if not self._has_load or load.num_tokens != self._load.num_tokens:
                self._progress_at = time.monotonic()
            self._load, self._has_load, self._load_at = load, True, time.monotonic()
        return recovered

    def check_failed(self, error: str, unreachable: bool = False) -> None:
        """A health check failed; ``unreachable``: nothing accepted the connection (the process is gone,
        not stalled: a stopped process's socket still accepts)."""
        self._last_error = error
        self._was_unreachable = self._was_unreachable or unreachable
        self._num_failed_checks += 1
        if not self._has_answered or self._num_failed_checks >= self._unhealthy_after_checks:
            self._is_healthy = False

    # --- the launcher ----------------------------------------------------------------------------

    def restarting(self, detail: str) -> None:
        self._is_restarting = True
        self._is_healthy = False
        self._last_error = detail

    def restarted(self) -> None:
        """A new process answers: in service at once, with none of the old one's failures held against it."""
        self._is_restarting = False
        self._is_healthy, self._has_answered, self._num_failed_checks = True, True, 0
        self._last_error = None
        self._load, self._has_load = EngineLoad(), False
        self.breaker.reset()
        self._forget_stranded()

    def warming(self) -> None:
        """Back, but out of service until its canaries have met its peers (``warmed``)."""
        self._is_warming = True

    def warmed(self) -> None:
        self._is_warming = False

    def gave_up(self, detail: str) -> None:
        """The launcher stopped restarting it; health checks still readmit it if someone starts it."""
        self._is_restarting = False
        self._is_healthy = False
        self._last_error = detail

    # --- requests -------------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests of this proxy open here, decode's early requests of pushes included."""
        return self._num_in_flight + self._num_early

    def dispatch(self) -> None:
        """One more request in flight here, until ``undispatch`` (in a ``finally``: plain calls, not a
        context manager, since every request makes two)."""
        now = time.monotonic()
        self.breaker.on_dispatch(now)
        if self._num_in_flight == 0:
            self._progress_at = now  # idle until now: the wait for progress starts here
        self._num_in_flight += 1

    def undispatch(self) -> None:
        self._num_in_flight -= 1
        if not self.num_in_flight:
            self._idle_since = time.monotonic()

    def hold_early(self) -> None:
        """Decode's request of a push, sent while prefill computes (legs.py), until ``release_early``: it is
        open here (load, draining, a supervisor asking whether a push may still come), but this engine owes
        it no step until prefill's WRITE lands, so it starts no wait for progress (``lag_s``): a slow or
        stalled prefill must not make its decode look stalled. The decode attempt that takes the request
        over dispatches it as any other."""
        self._num_early += 1

    def release_early(self) -> None:
        self._num_early -= 1
        if not self.num_in_flight:
            self._idle_since = time.monotonic()

    def owe_first_byte(self, key: int) -> None:
        """A streamed request here awaits its first byte until ``first_byte(key)`` (idempotent)."""
        self._awaiting_first[key] = time.monotonic()

    def first_byte(self, key: int) -> None:
        if self._awaiting_first.pop(key, None) is not None:
            self._progress_at = time.monotonic()

    def first_byte_wait_s(self, now: float) -> float:
        """How long the oldest streamed request here has waited for its first byte (0: none waits)."""
        return now - min(self._awaiting_first.values()) if self._awaiting_first else 0.0

    def lag_s(self, now: float) -> float:
        """How long its engine has shown no sign of stepping while the proxy has requests there: the
        oldest stream's wait for a first byte, or the time since its token counters last moved (or an
        answer came). 0 with nothing in flight. A stalled engine sends decode no lease heartbeats."""
        stalled = now - self._progress_at if self._num_in_flight else 0.0
        return max(stalled, self.first_byte_wait_s(now))

    def silence_s(self, now: float) -> float:
        """How long its engine has shown no sign of stepping (token counters that moved at a scrape, a
        stream's first byte, an answer) while the proxy has requests there; 0 with none. Unlike
        ``lag_s``, a stream queued for its first byte is no sign of a stall: a queue behind a stepping
        scheduler keeps its KV's lease alive."""
        return now - self._progress_at if self._num_in_flight else 0.0

    def succeeded(self) -> None:
        self._progress_at = time.monotonic()
        self.breaker.record_success()

    def failed(self, detail: str, is_slow: bool = False) -> None:
        """A failure of the instance itself (not of the client's request). Hard failures (refused,
        5xx, broken answers) count toward its breaker; a slow one (a timeout) does not: a slow instance
        is not a dead one, and health checks, not single timeouts, take it out of service."""
        self._last_error = detail
        if is_slow:
            return
        now = time.monotonic()
        was_closed = self.breaker.state(now) == "closed"
        self.breaker.record_failure(now)
        if was_closed and self.breaker.state(now) != "closed":
            log.warning("%s instance %s: circuit open after %d failures (%s)", self.role, self.url,
                        self.breaker.num_consecutive_failures, detail)  # fmt: skip

    # --- pushes that never came -----------------------------------------------------------------

    @property
    def num_stranded(self) -> int:
        """Pushes this decode may have registered blocks for that never came, since it last restarted
        or ended a rest."""
        return self._num_stranded

    def push_stranded(self) -> None:
        """A push this decode may have registered blocks for will never come (its prefill failed or was
        left; had the registration itself failed, vLLM freed them): past the limit it rests."""
        self._num_stranded += 1
        if self._is_resting or not 0 < self._rest_after <= self._num_stranded:
            return
        self._is_resting = True
        if not self.num_in_flight:
            self._idle_since = time.monotonic()
        log.warning("%s instance %s rests: it may hold the blocks of %d pushes that never came, which only "
                    "a restart frees; it takes requests only when no other instance can, until it restarts",
                    self.role, self.url, self._num_stranded)  # fmt: skip

    def _rests(self, now: float) -> bool:
        """Whether the rest goes on. Idle, it ends when its /metrics show it holds no block (the pushes'
        registrations failed, which frees them) or, not restarted past the time a supervisor takes to
        restart an idle decode that holds blocks, when nobody will: it serves again, holding them."""
        if self.num_in_flight:
            return True
        load = self._load
        if self._load_at > self._idle_since and not (load.kv_usage or load.num_running or load.num_waiting):
            why = "it holds no KV block: the pushes' registrations must have failed, which frees them"
        elif now - self._idle_since > self._rest_idle_limit_s:
            why = (f"idle {now - self._idle_since:.0f} s and not restarted (no supervisor?): a restart would "
                   f"free the blocks of the pushes that never came")  # fmt: skip
        else:
            return True
        log.warning("%s instance %s serves again: %s", self.role, self.url, why)
        self._forget_stranded()
        return False

    def _forget_stranded(self) -> None:
        self._num_stranded = 0
        self._is_resting = False

    # --- membership (called by ProxyState only) -------------------------------------------------

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    def start_draining(self) -> None:
        self._is_draining = True

    def mark_removed(self) -> None:
        self._is_draining = self._is_removed = True

    def describe(self) -> dict[str, object]:
        return {
            "role": self.role,
            "url": self.url,
            "state": self.lifecycle.value,
            "healthy": self._is_healthy,
            "draining": self._is_draining,
            "stranded_pushes": self._num_stranded,
            "circuit": self.breaker.state(time.monotonic()),
            "in_flight": self.num_in_flight,
            "running": self._load.num_running,
            "waiting": self._load.num_waiting,
            "kv_usage": self._load.kv_usage,
            "lag_s": round(self.lag_s(time.monotonic()), 1),
            "error": self._last_error,
        }
