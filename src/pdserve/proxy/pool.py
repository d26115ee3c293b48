"""The instances of one role and what the proxy knows about each: health, breaker, load, in-flight.

An instance takes traffic only while it is healthy (last active check), not draining, and its circuit
breaker is closed or half-open. Load comes from the proxy's own in-flight count plus the engine's
``/metrics`` (running, waiting, KV usage), refreshed by the health loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from pdserve.config import Role
from pdserve.engines.metrics import parse_prometheus
from pdserve.errors import UpstreamError
from pdserve.proxy.upstream import Upstream

log = logging.getLogger("pdserve.proxy")

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failures; after ``cooldown_s`` lets one trial request
    through (half-open); a success closes it, a failure opens it again."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 10.0) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.num_consecutive_failures = 0
        self._opened_at: float | None = None
        self._is_trial_out = False

    def state(self, now: float) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        return "half_open" if now - self._opened_at >= self.cooldown_s else "open"

    def allows(self, now: float) -> bool:
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self._is_trial_out)

    def on_dispatch(self, now: float) -> None:
        if self.state(now) == "half_open":
            self._is_trial_out = True

    def record_success(self) -> None:
        self.num_consecutive_failures = 0
        self._opened_at = None
        self._is_trial_out = False

    def record_failure(self, now: float) -> None:
        self.num_consecutive_failures += 1
        self._is_trial_out = False
        if self._opened_at is not None or self.num_consecutive_failures >= self.threshold:
            self._opened_at = now


@dataclass(frozen=True)
class EngineLoad:
    """What the engine's /metrics said at the last scrape."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1

    @classmethod
    def from_metrics(cls, text: str) -> EngineLoad:
        samples = parse_prometheus(text)
        return cls(
            samples.get("vllm:num_requests_running", 0.0),
            samples.get("vllm:num_requests_waiting", 0.0),
            samples.get("vllm:kv_cache_usage_perc", 0.0),
        )


class Instance:
    def __init__(self, upstream: Upstream, breaker: CircuitBreaker) -> None:
        self.upstream = upstream
        self.breaker = breaker
        self.num_in_flight = 0
        self.is_healthy = True  # optimistic until the first check: a fresh proxy serves at once
        self.has_answered = False  # a health check has succeeded at least once
        self.num_failed_checks = 0  # consecutive
        self.is_draining = False
        self.load = EngineLoad()
        self.last_error: str | None = None

    @property
    def url(self) -> str:
        return self.upstream.url

    @property
    def role(self) -> Role:
        return self.upstream.role

    def is_available(self, now: float) -> bool:
        return self.is_healthy and not self.is_draining and self.breaker.allows(now)

    @contextlib.contextmanager
    def dispatched(self) -> Iterator[None]:
        """Count one request in flight here for the duration of the block."""
        self.breaker.on_dispatch(time.monotonic())
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    def succeeded(self) -> None:
        self.breaker.record_success()

    def failed(self, detail: str) -> None:
        """A failure of the instance itself (not of the client's request): counts toward its breaker."""
        self.last_error = detail
        now = time.monotonic()
        was_closed = self.breaker.state(now) == "closed"
        self.breaker.record_failure(now)
        if was_closed and self.breaker.state(now) != "closed":
            log.warning("%s instance %s: circuit open after %d failures (%s)", self.role, self.url,
                        self.breaker.num_consecutive_failures, detail)  # fmt: skip

    def describe(self) -> dict[str, object]:
        return {
            "role": self.role,
            "url": self.url,
            "healthy": self.is_healthy,
            "draining": self.is_draining,
            "circuit": self.breaker.state(time.monotonic()),
            "in_flight": self.num_in_flight,
            "running": self.load.num_running,
            "waiting": self.load.num_waiting,
            "kv_usage": self.load.kv_usage,
            "error": self.last_error,
        }


class Pool:
    """The instances of one role."""

    def __init__(
        self,
        role: Role,
        instances: Sequence[Instance],
        on_recovered: Callable[[Instance], None] | None = None,
        unhealthy_after_checks: int = 3,
    ) -> None:
        self.role = role
        self.instances = list(instances)
        # One slow /health from a busy API server must not take a working instance out of service.
        self.unhealthy_after_checks = unhealthy_after_checks
        # Called when a check finds an unhealthy instance healthy again: it may have restarted, and a
        # restarted engine's prefix cache is empty, whatever the proxy remembers having sent there.
        self.on_recovered = on_recovered

    def available(self, exclude: Sequence[Instance] = ()) -> list[Instance]:
        now = time.monotonic()
        return [i for i in self.instances if i.is_available(now) and i not in exclude]

    def find(self, url: str) -> Instance | None:
        return next((i for i in self.instances if i.url == url), None)

    async def check(self, instance: Instance, timeout: float) -> None:
        """One active check: /health decides health; /metrics, when it answers, refreshes load."""
        was_healthy = instance.is_healthy
        try:
            reply = await instance.upstream.get("/health", "health", timeout)
            error = None if reply.status == 200 else f"/health answered {reply.status}"
        except UpstreamError as exc:
            error = exc.detail
        if error is not None:
            instance.last_error = error
            instance.num_failed_checks += 1
            if not instance.has_answered or instance.num_failed_checks >= self.unhealthy_after_checks:
                instance.is_healthy = False
            return
        instance.is_healthy, instance.has_answered, instance.num_failed_checks = True, True, 0
        instance.last_error = None
        if not was_healthy and self.on_recovered is not None:
            self.on_recovered(instance)
        with contextlib.suppress(UpstreamError):
            metrics = await instance.upstream.get("/metrics", "metrics", timeout)
            if metrics.status == 200:
                instance.load = EngineLoad.from_metrics(metrics.body.decode("utf-8", "replace"))

    async def check_all(self, timeout: float) -> None:
        await asyncio.gather(*(self.check(i, timeout) for i in self.instances))
