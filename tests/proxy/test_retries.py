"""Retries, circuit breakers and fallback with two prefill and two decode fakes behind one proxy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from fake_vllm import FakeVLLM
from proxy_rig import running_proxy, serve_fake
from test_flow import COMPLETION, post

from pdserve.configparts import ApiKeys, HealthChecks, PoolSpec, Retries


@dataclass(frozen=True)
class Pair:
    fakes: tuple[FakeVLLM, FakeVLLM]
    urls: tuple[str, str]


@dataclass(frozen=True)
class Pools:
    prefill: Pair
    decode: Pair

    def proxy(self, **config: Any) -> Any:
        """A proxy in front of all four fakes, retrying without backoff."""
        config = {"retries": NO_BACKOFF, **config}
        return running_proxy(list(self.prefill.urls), list(self.decode.urls), **config)


# Prefill's failures reach the client in this module unless a test turns decode's fallback on.
NO_BACKOFF = Retries(first_backoff_s=0.0, fallback_to_local_prefill=False, prefill_stands_in=False)


@pytest.fixture(scope="module")
def _fakes() -> Iterator[Pools]:
    p0, p1, d0, d1 = FakeVLLM("prefill"), FakeVLLM("prefill"), FakeVLLM("decode"), FakeVLLM("decode")
    with (
        serve_fake(p0) as p0_url,
        serve_fake(p1) as p1_url,
        serve_fake(d0) as d0_url,
        serve_fake(d1) as d1_url,
    ):
        yield Pools(Pair((p0, p1), (p0_url, p1_url)), Pair((d0, d1), (d0_url, d1_url)))


@pytest.fixture
def pools(_fakes: Pools) -> Pools:
    for fake in (*_fakes.prefill.fakes, *_fakes.decode.fakes):
        fake.reset()
    return _fakes


def _kv_ids(fake: FakeVLLM) -> list[str]:
    return [r.body["kv_transfer_params"]["remote_request_id"] for r in fake.generations()]


async def test_failing_prefill_is_retried_on_the_other_one(pools: Pools, http: aiohttp.ClientSession) -> None:
    pools.prefill.fakes[0].fault = "fail"
    with pools.proxy() as url:
        for _ in range(4):  # round robin would send half of them to the failing one first
            status, _, _ = await post(http, url + "/v1/completions", COMPLETION)
            assert status == 200
    assert len(pools.prefill.fakes[1].generations()) == 4


async def test_prefill_down_everywhere_falls_back_to_decode_alone_when_configured(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    for fake in pools.prefill.fakes:
        fake.fault = "fail"
    with pools.proxy(retries=Retries(first_backoff_s=0.0, fallback_to_local_prefill=True)) as url:
        status, _, _ = await post(http, url + "/v1/completions", COMPLETION, request_id="fallback")
        _, _, traces = await post_get(http, url + "/requests")
    assert status == 200
    served = pools.decode.fakes[0].generations() + pools.decode.fakes[1].generations()
    assert len(served) == 1 and "kv_transfer_params" not in served[0].body
    [trace] = [t for t in orjson.loads(traces)["requests"] if t["request_id"] == "fallback"]
    assert "prefill failed" in trace["local_prefill_reason"]


async def test_prefill_down_everywhere_without_fallback_is_the_instances_own_500(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    for fake in pools.prefill.fakes:
        fake.fault = "fail"
    with pools.proxy() as url:
        status, _, body = await post(http, url + "/v1/completions", COMPLETION)
    assert status == 500
    assert "prefill instance" in orjson.loads(body)["error"]["message"]
    assert not pools.decode.fakes[0].generations() and not pools.decode.fakes[1].generations()


async def test_unreachable_decode_is_retried_with_the_same_kv_params(
    pools: Pools, http: aiohttp.ClientSession, dead_url: str
) -> None:
    # The dead decode never saw the request, so prefill's params are still unread: reuse them.
    with running_proxy(
        retries=NO_BACKOFF,
        pools=(
            PoolSpec("prefill", (pools.prefill.urls[0],)),
            PoolSpec("decode", (dead_url, pools.decode.urls[1]), policy="round_robin"),
        ),
    ) as url:
        statuses = [(await post(http, url + "/v1/completions", COMPLETION))[0] for _ in range(2)]
    assert statuses == [200, 200]
    assert len(pools.prefill.fakes[0].generations()) == 2  # one prefill per request: nothing re-prefilled
    assert _kv_ids(pools.decode.fakes[1]) == [
        p["remote_request_id"] for p in pools.prefill.fakes[0].issued_kv_params
    ]


async def test_decode_failing_after_receiving_params_gets_a_fresh_prefill(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    pools.decode.fakes[0].fault = "fail"  # it received the params and may have pulled: never reuse them
    with pools.proxy() as url:
        status, _, _ = await post(http, url + "/v1/completions", COMPLETION)
    assert status == 200
    issued = [p["remote_request_id"] for f in pools.prefill.fakes for p in f.issued_kv_params]
    assert len(issued) == 2
    used_by_healthy = _kv_ids(pools.decode.fakes[1])
    assert len(used_by_healthy) == 1 and used_by_healthy[0] not in _kv_ids(pools.decode.fakes[0])


async def test_streamed_error_before_any_token_is_retried_elsewhere(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    pools.decode.fakes[0].fault = "error_event_first"
    with pools.proxy() as url:
        status, _, body = await post(http, url + "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200
    assert b'"error"' not in body and body.rstrip().endswith(b"data: [DONE]")
    assert len(pools.decode.fakes[1].generations()) == 1


async def test_circuit_opens_after_repeated_failures_and_traffic_moves_away(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    pools.prefill.fakes[0].fault = "fail"
    with pools.proxy(
        health=HealthChecks(breaker_threshold=2, breaker_cooldown_s=60),
        retries=Retries(first_backoff_s=0.0, fallback_to_local_prefill=False),
        pools=(
            PoolSpec("prefill", pools.prefill.urls, max_attempts=1),
            PoolSpec("decode", pools.decode.urls),
        ),
    ) as url:
        statuses = [(await post(http, url + "/v1/completions", COMPLETION))[0] for _ in range(8)]
        _, _, listing = await post_get(http, url + "/instances")
    # Round robin: the failing instance takes requests 1 and 3, then its circuit opens.
    assert statuses == [500, 200, 500, 200, 200, 200, 200, 200]
    assert len(pools.prefill.fakes[0].generations()) == 2
    [broken] = [i for i in orjson.loads(listing) if i["url"] == pools.prefill.urls[0]]
    assert broken["circuit"] == "open"


async def test_with_every_circuit_open_the_likeliest_instance_is_still_tried_panic_mode(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    for fake in pools.prefill.fakes:
        fake.fault = "fail"
    with pools.proxy(health=HealthChecks(breaker_threshold=1, breaker_cooldown_s=60)) as url:
        await post(http, url + "/v1/completions", COMPLETION)
        tried_before = sum(len(f.generations()) for f in pools.prefill.fakes)
        for fake in pools.prefill.fakes:
            fake.fault = None  # they recover; their circuits are still open for a minute
        status, _, body = await post(http, url + "/v1/completions", COMPLETION)
    # One flap of every instance does not become a minute of refusals: the request is served.
    assert status == 200, body
    assert sum(len(f.generations()) for f in pools.prefill.fakes) == tried_before + 1


async def test_with_every_instance_draining_the_answer_is_a_503_with_retry_after(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    with pools.proxy(api_keys=ApiKeys(admin="k"), retries=Retries(first_backoff_s=0.0)) as url:
        for instance_url in (*pools.decode.urls, *pools.prefill.urls):
            async with http.post(url + "/admin/instances/drain", json={"url": instance_url},
                                 headers={"Authorization": "Bearer k"}) as resp:  # fmt: skip
                assert resp.status == 200
        async with http.post(url + "/v1/completions", json=COMPLETION) as resp:
            status, retry_after, body = resp.status, resp.headers.get("Retry-After"), await resp.read()
    assert status == 503 and retry_after is not None and int(retry_after) >= 1
    message = orjson.loads(body)["error"]["message"]
    assert "no decode instance available" in message and "draining" in message
    assert "no prefill instance can serve it whole" in message


async def test_with_every_decode_draining_a_prefill_serves_the_request_whole(
    pools: Pools, http: aiohttp.ClientSession
) -> None:
    with pools.proxy(api_keys=ApiKeys(admin="k"), retries=Retries(first_backoff_s=0.0)) as url:
        for instance_url in pools.decode.urls:
            async with http.post(url + "/admin/instances/drain", json={"url": instance_url},
                                 headers={"Authorization": "Bearer k"}) as resp:  # fmt: skip
                assert resp.status == 200
        status, _, body = await post(http, url + "/v1/completions", COMPLETION)
        _, _, metrics = await post_get(http, url + "/metrics")
    assert status == 200, body
    assert b"pdserve_stand_ins_total 1" in metrics
    assert not pools.decode.fakes[0].generations() and not pools.decode.fakes[1].generations()


async def post_get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any, bytes]:
    async with http.get(url) as resp:
        return resp.status, resp.headers, await resp.read()
