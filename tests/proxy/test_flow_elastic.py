"""An elastic pool behind the real proxy: simulated instances of role "both", each able to prefill for
another, pull from another, or serve a request whole; the router decides per request."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from proxy_rig import DiesAfterItsFirstCheck, elastic_pool, running_proxy
from sim_matrix import PROFILE, all_stats

from pdserve.configparts import ElasticPool
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.slo import Slo

MODEL = "sim-model"
LONG = "river " * 3000  # ~4,500 tokens by the proxy's estimate: the unplanned rule splits it
SHORT = "Hello there"


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[str, ...]]:
    with sim_in_thread([SimInstanceSpec("both")] * 3, PROFILE) as cluster:
        yield tuple(cluster.urls)


@pytest.fixture
def proxy(pool: tuple[str, ...]) -> Iterator[str]:
    with running_proxy(pools=elastic_pool(pool)) as url:
        yield url


async def _complete(
    http: aiohttp.ClientSession, url: str, prompt: str, request_id: str, **extra: Any
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, **extra}
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp:
        answer = await resp.read()
        assert resp.status == 200, answer
        return dict(orjson.loads(answer))


async def _placement(http: aiohttp.ClientSession, url: str, request_id: str) -> dict[str, Any]:
    async with http.get(f"{url}/requests") as resp:
        traces = (await resp.json())["requests"]
    trace = next(t for t in traces if t["request_id"] == request_id)
    return dict(trace["placement"])


async def _pulls(http: aiohttp.ClientSession, pool: tuple[str, ...]) -> int:
    return sum(int(s["num_pulls_ok"]) for s in await all_stats(http, pool))


async def test_a_long_prompt_is_split_over_two_instances_and_its_kv_pulled_once(
    pool: tuple[str, ...], proxy: str
) -> None:
    async with aiohttp.ClientSession() as http:
        before = await _pulls(http, pool)
        answer = await _complete(http, proxy, LONG, "elastic-long")
        placement = await _placement(http, proxy, "elastic-long")
        assert placement["split"] is True
        assert placement["prefill_url"] in pool and placement["decode_url"] in pool
        assert placement["prefill_url"] != placement["decode_url"]
        assert await _pulls(http, pool) == before + 1
    assert answer["usage"]["completion_tokens"] == 6


async def test_a_short_prompt_is_served_whole_with_no_transfer(pool: tuple[str, ...], proxy: str) -> None:
    async with aiohttp.ClientSession() as http:
        before = await _pulls(http, pool)
        answer = await _complete(http, proxy, SHORT, "elastic-short")
        placement = await _placement(http, proxy, "elastic-short")
        assert await _pulls(http, pool) == before
    assert placement["split"] is False and placement["prefill_url"] is None
    assert "whole" in placement["reason"]
    assert answer["usage"]["completion_tokens"] == 6


async def test_prompt_logprobs_are_served_whole_whatever_the_router_placed(
    pool: tuple[str, ...], proxy: str
) -> None:
    async with aiohttp.ClientSession() as http:
        before = await _pulls(http, pool)
        answer = await _complete(http, proxy, LONG, "elastic-plp", prompt_logprobs=0)
        placement = await _placement(http, proxy, "elastic-plp")
        assert await _pulls(http, pool) == before
    assert placement["split"] is False and "served whole: prompt logprobs" in placement["reason"]
    assert answer["choices"][0]["prompt_logprobs"]


async def test_instances_show_their_side(pool: tuple[str, ...], proxy: str) -> None:
    async with aiohttp.ClientSession() as http:
        await _complete(http, proxy, SHORT, "elastic-sides")
        async with http.get(f"{proxy}/instances") as resp:
            instances = await resp.json()
    assert sorted(i["url"] for i in instances) == sorted(pool)  # each once, though it serves both roles
    assert {i["role"] for i in instances} == {"elastic"}
    assert all(i["side"] in ("prefill", "decode") for i in instances)
    # A decode-side instance shows what it runs and the most the hold lets it run; a prefill-side, none.
    assert all((i["decode_batch"] is None) == (i["side"] == "prefill") for i in instances)
    assert all(set(i["decode_batch"]) == {"running", "most"} for i in instances if i["side"] == "decode")


@pytest.mark.parametrize("attempts", [1, 2])
async def test_a_dead_prefill_leaves_the_request_to_another_or_to_its_decode(
    pool: tuple[str, ...], attempts: int
) -> None:
    """Survivors take every role: the router's prefill refuses connections; a second attempt prefills
    elsewhere (never on the decode itself), and with none left the decode computes the prompt. The
    client never hears of it."""
    dying = DiesAfterItsFirstCheck()
    members = (pool[0], dying.url, pool[1])  # the router's ties go in order: decode pool[0], prefill dead
    with running_proxy(pools=elastic_pool(members, max_attempts=attempts)) as proxy:
        dead = dying.died()
        async with aiohttp.ClientSession() as http:
            answer = await _complete(http, proxy, LONG, f"elastic-dead-{attempts}")
            async with http.get(f"{proxy}/requests") as resp:
                trace = next(
                    t
                    for t in (await resp.json())["requests"]
                    if t["request_id"] == f"elastic-dead-{attempts}"
                )
    assert trace["placement"]["prefill_url"] == dead and trace["placement"]["decode_url"] == pool[0]
    assert any(dead in r for r in trace["retries"])
    if attempts == 2:
        assert trace["prefill_url"] == pool[1] and trace["local_prefill_reason"] is None
    else:
        assert "decode computes the prompt" in trace["local_prefill_reason"]
    assert answer["usage"]["completion_tokens"] == 6


async def test_a_dead_decode_hands_the_kv_to_another_instance(pool: tuple[str, ...]) -> None:
    """The router's decode refuses connections: it never read prefill's params, so the retry takes
    them to another instance than the one holding the KV, which pulls it: nothing is left held."""
    dying = DiesAfterItsFirstCheck()
    with running_proxy(pools=elastic_pool((dying.url, *pool))) as proxy:
        dead = dying.died()
        async with aiohttp.ClientSession() as http:
            before = await _pulls(http, pool)
            answer = await _complete(http, proxy, LONG, "elastic-dead-decode")
            async with http.get(f"{proxy}/requests") as resp:
                traces = (await resp.json())["requests"]
            assert await _pulls(http, pool) == before + 1
    trace = next(t for t in traces if t["request_id"] == "elastic-dead-decode")
    assert trace["placement"]["decode_url"] == dead
    assert trace["decode_url"] in pool and trace["decode_url"] != trace["prefill_url"]
    assert trace["local_prefill_reason"] is None
    assert answer["usage"]["completion_tokens"] == 6


async def test_with_step_costs_a_prompt_cheaper_than_a_decode_step_stays_whole(pool: tuple[str, ...]) -> None:
    """Costs of an engine whose step costs 5 ms and prompts nearly nothing: a split would cost a hop and
    save less than a step, so the router serves it whole on a decode, whatever the layout."""
    costs = dataclasses.replace(PROFILE, step_base_s=0.005, prefill_per_token_s=1e-6).costs()
    settings = ElasticPool(costs=costs, slo=Slo(ttft_ms=1000, tpot_ms=50))
    with running_proxy(pools=elastic_pool(pool), elastic_pool=settings) as proxy:
        async with aiohttp.ClientSession() as http:
            before = await _pulls(http, pool)
            for i in range(4):
                await _complete(http, proxy, "short question " * 10, f"elastic-costs-{i}", max_tokens=200)
            placement = await _placement(http, proxy, "elastic-costs-3")
            assert await _pulls(http, pool) == before
    assert placement["split"] is False and "cost less than a decode step" in placement["reason"]


async def test_metrics_count_placements_and_show_the_layout(pool: tuple[str, ...], proxy: str) -> None:
    async with aiohttp.ClientSession() as http:
        await _complete(http, proxy, LONG, "elastic-metrics-split")
        await _complete(http, proxy, SHORT, "elastic-metrics-whole")
        async with http.get(f"{proxy}/metrics") as resp:
            text = await resp.text()
    assert 'pdserve_elastic_placements_total{placement="split"} 1' in text
    assert 'pdserve_elastic_placements_total{placement="whole"} 1' in text
    assert 'pdserve_elastic_layout_info{layout="unplanned"}' not in text  # no costs: not planned yet
    assert text.count("pdserve_elastic_instance_side{") == len(pool)
    assert f'pdserve_instance_in_flight{{role="elastic",url="{pool[0]}"}}' in text


async def test_streams_that_end_well_calibrate_the_router_and_metrics_show_it(pool: tuple[str, ...]) -> None:
    """Streamed answers tell the router what they measured against what it predicted: the sample count
    moves by one a stream, and the factors the plans use are on /metrics."""
    settings = ElasticPool(costs=PROFILE.costs(), slo=Slo(ttft_ms=1000, tpot_ms=50))
    with running_proxy(pools=elastic_pool(pool), elastic_pool=settings) as proxy:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                body = {"model": MODEL, "prompt": SHORT, "max_tokens": 8, "stream": True}
                async with http.post(f"{proxy}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            await _complete(http, proxy, SHORT, "elastic-calibration-whole")  # not streamed: not measured
            async with http.get(f"{proxy}/metrics") as resp:
                text = await resp.text()
    samples = [line for line in text.splitlines() if line.startswith("pdserve_elastic_calibration_samples")]
    assert sorted(samples) == [
        'pdserve_elastic_calibration_samples{kind="split"} 0',
        'pdserve_elastic_calibration_samples{kind="whole"} 3',
    ]
    assert 'pdserve_elastic_calibration_factor{kind="whole",metric="tpot"} 1' in text  # 3 < 8: not yet


async def test_beyond_what_the_tpot_objective_allows_requests_wait_then_are_served_in_full(
    pool: tuple[str, ...],
) -> None:
    """Step costs by which one sequence per instance is all a 12 ms TPOT allows: six streams at once, and
    those beyond one per decode-side instance wait at the proxy, then each gets its whole answer."""
    costs = dataclasses.replace(PROFILE, step_base_s=0.005, decode_per_seq_s=0.004, prefill_per_token_s=1e-6)
    settings = ElasticPool(costs=costs.costs(), slo=Slo(ttft_ms=1000, tpot_ms=12))
    with running_proxy(pools=elastic_pool(pool), elastic_pool=settings) as proxy:
        async with aiohttp.ClientSession() as http:

            async def stream(i: int) -> bytes:
                body = {"model": MODEL, "prompt": SHORT, "max_tokens": 40, "stream": True}
                headers = {"X-Request-Id": f"elastic-held-{i}"}
                async with http.post(f"{proxy}/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == 200
                    return await resp.read()

            answers = await asyncio.gather(*(stream(i) for i in range(6)))
            held = [(await _placement(http, proxy, f"elastic-held-{i}"))["held_ms"] for i in range(6)]
            async with http.get(f"{proxy}/metrics") as resp:
                text = await resp.text()
    assert all(a.endswith(b"data: [DONE]\n\n") and a.count(b'"text"') == 40 for a in answers)
    assert sum(1 for ms in held if ms > 0) >= 3  # three instances at most, one request each
    assert 'pdserve_elastic_held_total{result="overdue"} 0' in text
    assert "pdserve_elastic_holding 0" in text
