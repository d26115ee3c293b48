"""Instance lifecycle without sockets: circuit breakers, availability, health checks and recovery."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.config import ProxyConfig
from pdserve.configparts import HealthChecks, PoolSpec
from pdserve.errors import UpstreamUnavailable
from pdserve.proxy.pool.breaker import CircuitBreaker
from pdserve.proxy.pool.health import HealthChecker
from pdserve.proxy.pool.instance import EngineLoad, Instance, Lifecycle
from pdserve.proxy.pool.policies import make_policy
from pdserve.proxy.pool.state import Pool, ProxyState
from pdserve.proxy.wire.upstream import Reply

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

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None


def one_instance(upstream: StubUpstream, unhealthy_after_checks: int = 3) -> tuple[ProxyState, Instance]:
    """A ProxyState whose one decode instance talks to ``upstream`` (back from unhealthy it serves at
    once: its warm-up with prefill is test_warmup's)."""
    health = HealthChecks(unhealthy_after_checks=unhealthy_after_checks, warmup_timeout_s=0)
    pools = (PoolSpec("prefill", ("http://p:1",)), PoolSpec("decode", (upstream.url,), policy="prefix_aware"))
    config = ProxyConfig(pools=pools, health=health)
    policies = {"prefill": make_policy("round_robin"), "decode": make_policy("prefix_aware")}
    state = ProxyState(
        config, policies, lambda role, url: upstream if url == upstream.url else StubUpstream(url)
    )  # type: ignore[arg-type,return-value]
    [instance] = state.pool("decode").instances
    return state, instance


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


async def test_health_checks_refresh_load_and_an_instance_that_recovers_is_forgotten_once() -> None:
    upstream = StubUpstream()
    state, instance = one_instance(upstream, unhealthy_after_checks=1)
    checker = HealthChecker(state, interval_s=1, timeout_s=1)
    policy = state.policy("decode")
    policy.pick([instance], [1, 2, 3])  # the proxy now thinks the instance caches these blocks
    await checker.check(instance)
    assert instance.is_healthy
    assert (
        policy.pick([instance], [1, 2, 3]).num_cached_tokens > 0
    )  # healthy from the start: nothing forgotten
    assert instance.load == EngineLoad(num_running=3.0, num_waiting=2.0)
    upstream.health = UpstreamUnavailable("health", upstream.url, "cannot connect")
    await checker.check(instance)
    assert not instance.is_healthy and state.pool("decode").available() == []
    assert instance.lifecycle is Lifecycle.UNHEALTHY
    upstream.health = 200
    await checker.check(instance)
    assert policy.pick([instance], [1, 2, 3]).num_cached_tokens == 0  # back from unhealthy: maybe restarted
    await checker.check(instance)
    assert policy.pick([instance], [1, 2, 3]).num_cached_tokens > 0  # reported once, not at every check
    assert state.pool("decode").available() == [instance]


async def test_the_checks_begin_when_the_proxy_starts_so_its_first_requests_find_each_engines_load() -> None:
    # prefill's lease counter among that load: without it the lease guard suspects any late answer
    upstream = StubUpstream()
    state, instance = one_instance(upstream)
    checker = asyncio.create_task(HealthChecker(state, interval_s=3600, timeout_s=1).run())
    try:
        for _ in range(100):
            if instance.load.num_running:
                break
            await asyncio.sleep(0.01)
    finally:
        checker.cancel()
    assert instance.load == EngineLoad(num_running=3.0, num_waiting=2.0)


async def test_one_slow_health_check_does_not_take_a_working_instance_out_of_service() -> None:
    upstream = StubUpstream()
    state, instance = one_instance(upstream, unhealthy_after_checks=3)
    checker = HealthChecker(state, interval_s=1, timeout_s=1)
    await checker.check(instance)
    upstream.health = UpstreamUnavailable("health", upstream.url, "no answer within 5 s")
    for expected in (True, True, False):  # out only at the third miss in a row
        await checker.check(instance)
        assert instance.is_healthy is expected


async def test_an_instance_that_never_answered_is_out_at_its_first_failed_check() -> None:
    upstream = StubUpstream(health=UpstreamUnavailable("health", "http://stub:1", "cannot connect"))
    state, instance = one_instance(upstream, unhealthy_after_checks=3)
    await HealthChecker(state, interval_s=1, timeout_s=1).check(instance)
    assert not instance.is_healthy and instance.last_error == "cannot connect"


def test_draining_or_circuit_open_instances_take_no_new_requests() -> None:
    a = Instance(StubUpstream("http://a:1"), CircuitBreaker(threshold=1))  # type: ignore[arg-type]
    b = Instance(StubUpstream("http://b:1"), CircuitBreaker())  # type: ignore[arg-type]
    pool = Pool("prefill", [a, b])
    a.failed("answered 500")
    assert pool.available() == [b]
    b.start_draining()
    assert pool.available() == []
    assert pool.available(exclude=[b]) == []
    assert b.lifecycle is Lifecycle.DRAINING


def test_a_decode_holding_pushes_that_never_came_rests_while_another_serves_until_it_restarts() -> None:
    a = Instance(StubUpstream("http://a:1"), CircuitBreaker(), rest_after_stranded=2)  # type: ignore[arg-type]
    b = Instance(StubUpstream("http://b:1"), CircuitBreaker())  # type: ignore[arg-type]
    pool = Pool("decode", [a, b])
    a.push_stranded()
    assert pool.available() == [a, b]  # one may be a false alarm: the registration may not have gone out
    a.push_stranded()
    assert a.lifecycle is Lifecycle.RESTING and a.describe()["stranded_pushes"] == 2
    assert pool.available() == [b]
    # resting never refuses a request: with no other decode in service it takes them
    b.start_draining()
    assert pool.available() == [a] and pool.has_available()
    a.restarting("exited: restarted to free KV blocks")
    a.restarted()
    assert a.lifecycle is Lifecycle.SERVING and a.num_stranded == 0


def test_a_rest_that_no_restart_ends_ends_once_the_decode_sat_idle_past_the_supervisors_time() -> None:
    a = Instance(StubUpstream("http://a:1"), CircuitBreaker(), rest_after_stranded=1, rest_idle_limit_s=5.0)  # type: ignore[arg-type]
    b = Instance(StubUpstream("http://b:1"), CircuitBreaker())  # type: ignore[arg-type]
    pool = Pool("decode", [a, b])
    a.dispatch()
    a.push_stranded()
    assert pool.available() == [b]
    a.undispatch()
    now = time.monotonic()
    assert not a.is_available(now + 4.0)  # idle, but a supervisor may still be about to restart it
    assert a.is_available(now + 6.0)  # nobody restarts it: it serves again rather than sit out forever
    assert a.lifecycle is Lifecycle.SERVING and a.num_stranded == 0


def test_a_resting_decode_whose_metrics_show_no_block_held_once_idle_serves_again_at_once() -> None:
    a = Instance(StubUpstream("http://a:1"), CircuitBreaker(), rest_after_stranded=1)  # type: ignore[arg-type]
    a.dispatch()
    a.push_stranded()
    a.check_passed(EngineLoad(num_running=1.0, kv_usage=0.2))
    a.undispatch()
    assert not a.is_available(time.monotonic())  # its last scrape is older than its idleness
    a.check_passed(EngineLoad(kv_usage=0.001))  # idle, holding a block: the supervisor's to restart
    assert not a.is_available(time.monotonic())
    # the registration had failed (vLLM then frees the blocks): nothing held, nothing to rest for
    a.check_passed(EngineLoad())
    assert a.is_available(time.monotonic()) and a.num_stranded == 0
