"""A returning instance meets its peers (a canary handoff per pair) before it takes requests."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from memory_upstream import Answer, MemoryUpstream, Recorder, Script

from pdserve import sse
from pdserve.config import ProxyConfig, Role, Timeouts
from pdserve.configparts import HealthChecks, Retries
from pdserve.events import InstanceEvent
from pdserve.proxy.pool.instance import Lifecycle
from pdserve.proxy.pool.policies import make_policy
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.pool.warmup import pairs_of
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.request.flow import Flow
from pdserve.proxy.serving.admission import Admission
from pdserve.proxy.serving.exposition import render

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2, 3],
          "remote_request_id": "cmpl-r", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}  # fmt: skip
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 5}


def prefill(delay_s: float = 0.0) -> Script:
    def answer(body: dict[str, Any]) -> Answer:
        slow = str(body.get("cache_salt", "")).startswith("warmup-")
        return Answer(body=orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}),
                      delay_s=delay_s if slow else 0.0)  # fmt: skip

    return answer


def decode(status: int = 200) -> Script:
    def answer(body: dict[str, Any]) -> Answer:
        if body.get("stream"):
            chunk = sse.event(orjson.dumps({"choices": [{"text": " ok"}]}))
            return Answer(chunks=[chunk, sse.DONE], content_type="text/event-stream")
        return Answer(status=status, body=orjson.dumps({"choices": [{"text": " ok"}]}))

    return answer


class System:
    def __init__(self, prefill: list[Script], decode: list[Script], **health: Any) -> None:
        urls = {"prefill": [f"http://p{i}:1" for i in range(len(prefill))],
                "decode": [f"http://d{i}:1" for i in range(len(decode))]}  # fmt: skip
        scripts = dict(zip(urls["prefill"] + urls["decode"], prefill + decode, strict=True))
        self.upstreams: dict[str, MemoryUpstream] = {}

        def make(role: Role, url: str) -> MemoryUpstream:
            self.upstreams[url] = MemoryUpstream(role, url, scripts[url])
            return self.upstreams[url]

        config = ProxyConfig.pd(urls["prefill"], urls["decode"], timeouts=Timeouts(),
                             retries=Retries(first_backoff_s=0), health=HealthChecks(**health))  # fmt: skip
        policies = {"prefill": make_policy("round_robin"), "decode": make_policy("round_robin")}
        self.state = ProxyState(config, policies, make)  # type: ignore[arg-type]
        self.flow = Flow(self.state, config)

    def calls(self, url: str) -> list[dict[str, Any]]:
        return [c.body for c in self.upstreams[url].calls]

    def lifecycle(self, url: str) -> Lifecycle:
        instance = self.state.find(url)
        assert instance is not None
        return instance.lifecycle

    async def restart(self, url: str) -> None:
        self.state.on_event(InstanceEvent(url, "restarting", "exited with code 1"))
        self.state.on_event(InstanceEvent(url, "ready", ""))

    async def ask(self, body: dict[str, Any]) -> Recorder:
        send = Recorder()
        await self.flow.serve("completions", orjson.dumps(body), None, Responder(send, "r"))
        return send

    def metrics(self) -> str:
        return render(self.state, Admission(None, 0, 1.0))

    async def settle(self) -> None:
        for _ in range(50):
            await asyncio.sleep(0.01)


async def test_a_restarted_prefill_is_paired_with_each_decode_before_it_serves() -> None:
    system = System([prefill()], [decode(), decode()])
    await system.restart("http://p0:1")
    assert system.lifecycle("http://p0:1") is Lifecycle.WARMING
    await system.settle()
    assert system.lifecycle("http://p0:1") is Lifecycle.SERVING
    canaries = system.calls("http://p0:1")
    assert len(canaries) == 2 and {c["max_tokens"] for c in canaries} == {1}
    assert all(c["kv_transfer_params"]["do_remote_decode"] is True for c in canaries)
    # A fresh salt each: a prompt decode found in its own cache would skip the pull, and the handshake.
    assert len({c["cache_salt"] for c in canaries}) == 2
    for url in ("http://d0:1", "http://d1:1"):
        [pulled] = system.calls(url)
        assert pulled["kv_transfer_params"] == PARAMS and pulled["max_tokens"] == 1
    assert 'pdserve_warmups_total{result="ok"} 1' in system.metrics()


async def test_a_restarted_decode_pulls_once_from_each_prefill() -> None:
    system = System([prefill(), prefill()], [decode()])
    await system.restart("http://d0:1")
    await system.settle()
    assert len(system.calls("http://d0:1")) == 2
    assert len(system.calls("http://p0:1")) == len(system.calls("http://p1:1")) == 1


async def test_a_request_while_the_only_prefill_warms_is_served_not_refused() -> None:
    system = System([prefill(delay_s=0.5)], [decode()])
    await system.restart("http://p0:1")
    answer = await system.ask(COMPLETION)
    assert system.lifecycle("http://p0:1") is Lifecycle.WARMING  # the canary still waits on prefill
    assert answer.status == 200 and b" ok" in answer.body


async def test_a_failed_canary_is_counted_and_the_instance_serves_anyway() -> None:
    system = System([prefill()], [decode(status=500)])
    await system.restart("http://p0:1")
    await system.settle()
    assert system.lifecycle("http://p0:1") is Lifecycle.SERVING
    assert 'pdserve_warmups_total{result="failed"} 1' in system.metrics()


async def test_a_canary_past_the_warmup_timeout_lets_the_instance_serve() -> None:
    system = System([prefill(delay_s=5.0)], [decode()], warmup_timeout_s=0.1)
    await system.restart("http://p0:1")
    await asyncio.sleep(0.3)
    assert system.lifecycle("http://p0:1") is Lifecycle.SERVING
    assert 'pdserve_warmups_total{result="failed"} 1' in system.metrics()


async def test_no_warmup_when_it_is_off() -> None:
    system = System([prefill()], [decode()], warmup_timeout_s=0)
    await system.restart("http://p0:1")
    assert system.lifecycle("http://p0:1") is Lifecycle.SERVING
    await system.settle()
    assert system.calls("http://p0:1") == []


async def test_an_instance_back_from_unreachable_warms_too() -> None:
    """Restarted by something other than pdserve's launcher: its checks could not connect, then pass."""
    system = System([prefill()], [decode()])
    state, instance = system.state, system.state.find("http://p0:1")
    assert instance is not None
    state.check_failed(instance, "cannot connect", unreachable=True)  # never answered: out at once
    state.check_passed(instance, None)
    assert instance.lifecycle is Lifecycle.WARMING
    await system.settle()
    assert instance.lifecycle is Lifecycle.SERVING and len(system.calls("http://d0:1")) == 1


async def test_a_stalled_instance_back_from_unhealthy_serves_at_once() -> None:
    """A stopped process still accepts connections, its checks time out: the same process, already met."""
    system = System([prefill()], [decode()])
    state, instance = system.state, system.state.find("http://p0:1")
    assert instance is not None
    state.check_failed(instance, "no answer within 5 s")
    state.check_passed(instance, None)
    assert instance.lifecycle is Lifecycle.SERVING
    await system.settle()
    assert system.calls("http://d0:1") == []


async def test_an_elastic_instance_meets_every_other_in_both_directions() -> None:
    system = System([prefill()], [decode(), decode()])
    a, b, c = (system.state.find(u) for u in ("http://p0:1", "http://d0:1", "http://d1:1"))
    assert a is not None and b is not None and c is not None
    assert pairs_of(b, [a, b, c], elastic=True) == [(b, a), (a, b), (b, c), (c, b)]
    assert pairs_of(b, [a], elastic=False) == [(a, b)]
