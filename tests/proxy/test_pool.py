"""Instance state without sockets: circuit breakers, availability, health checks and recovery."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import UpstreamUnavailable
from pdserve.proxy.pool import CircuitBreaker, EngineLoad, Instance, Pool
from pdserve.proxy.upstream import Reply

METRICS = b'vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_waiting{engine="0"} 2.0\n'


@dataclass
class StubUpstream:
    """Answers /health with ``health`` (an exception means unreachable) and /metrics with METRICS."""

    url: str = "http://stub:1"
    role: str = "decode"
    health: int | Exception = 200

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        if path == "/health":
            if isinstance(self.health, Exception):
                raise self.health
            return Reply(self.health, "application/json", b"")
        return Reply(200, "text/plain", METRICS)


def test_breaker_opens_after_threshold_then_lets_one_trial_through_after_cooldown() -> None:
    breaker = CircuitBreaker(threshold=2, cooldown_s=10)
    breaker.record_failure(now=0)
    assert breaker.state(0) == "closed"
    breaker.record_failure(now=1)
    assert breaker.state(1) == "open" and not breaker.allows(5)
    assert breaker.state(11) == "half_open" and breaker.allows(11)
    breaker.on_dispatch(11)
    assert not breaker.allows(11)  # one trial at a time
    breaker.record_failure(now=12)
    assert breaker.state(12) == "open"  # the trial failed: open again, a fresh cooldown
    breaker.record_success()
    assert breaker.state(100) == "closed"


async def test_health_checks_refresh_load_and_an_instance_that_recovers_is_reported_once() -> None:
    upstream = StubUpstream()
    instance = Instance(upstream, CircuitBreaker())  # type: ignore[arg-type]
    recovered: list[str] = []
    pool = Pool(
        "decode", [instance], on_recovered=lambda i: recovered.append(i.url), unhealthy_after_checks=1
    )
    await pool.check(instance, timeout=1)
    assert instance.is_healthy and recovered == []  # healthy from the start: nothing to forget
    assert instance.load == EngineLoad(num_running=3.0, num_waiting=2.0)
    upstream.health = UpstreamUnavailable("health", upstream.url, "cannot connect")
    await pool.check(instance, timeout=1)
    assert not instance.is_healthy and pool.available() == []
    upstream.health = 200
    await pool.check(instance, timeout=1)
    await pool.check(instance, timeout=1)
    assert recovered == [upstream.url]
    assert pool.available() == [instance]


async def test_one_slow_health_check_does_not_take_a_working_instance_out_of_service() -> None:
    upstream = StubUpstream()
    instance = Instance(upstream, CircuitBreaker())  # type: ignore[arg-type]
    pool = Pool("decode", [instance], unhealthy_after_checks=3)
    await pool.check(instance, timeout=1)
    upstream.health = UpstreamUnavailable("health", upstream.url, "no answer within 5 s")
    for expected in (True, True, False):  # out only at the third miss in a row
        await pool.check(instance, timeout=1)
        assert instance.is_healthy is expected


async def test_an_instance_that_never_answered_is_out_at_its_first_failed_check() -> None:
    upstream = StubUpstream(health=UpstreamUnavailable("health", "http://stub:1", "cannot connect"))
    instance = Instance(upstream, CircuitBreaker())  # type: ignore[arg-type]
    pool = Pool("decode", [instance], unhealthy_after_checks=3)
    await pool.check(instance, timeout=1)
    assert not instance.is_healthy and instance.last_error == "cannot connect"


def test_draining_or_circuit_open_instances_take_no_new_requests() -> None:
    a, b = (
        Instance(StubUpstream("http://a:1"), CircuitBreaker(threshold=1)),
        Instance(  # type: ignore[arg-type]
            StubUpstream("http://b:1"),
            CircuitBreaker(),  # type: ignore[arg-type]
        ),
    )
    pool = Pool("prefill", [a, b])
    a.failed("answered 500")
    assert pool.available() == [b]
    b.is_draining = True
    assert pool.available() == []
    assert pool.available(exclude=[b]) == []
