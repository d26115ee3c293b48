"""Stalls, restarts and heartbeats over the sims' HTTP API (``POST /sim/stall``, ``/sim/restart``,
``/sim/kv/heartbeat``), as a client and a decode in another process see them."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from sim_rig import INTERNAL_ERROR, PROFILE, PROMPT, completion, metric, post, prefill, stats

from pdserve.sim.fleet import SimCluster, SimInstanceSpec, sim_in_thread

LEASE_S = 3.0  # a heartbeat extends a lease to 3 * 2 // 3 = 2 s from when prefill reads it
STEP_S = 0.005


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    profile = dataclasses.replace(PROFILE, kv_lease_s=LEASE_S, step_base_s=STEP_S)
    with sim_in_thread([SimInstanceSpec("prefill"), SimInstanceSpec("decode")], profile) as c:
        yield c


async def engine_id(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/sim/stats") as resp:
        return str((await resp.json())["engine_id"])


async def test_a_stalled_engine_answers_after_the_stall_while_its_http_server_keeps_answering(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    decode = cluster.urls[1]
    status, payload = await post(http, f"{decode}/sim/stall", {"seconds": 1.0})
    assert status == 200 and orjson.loads(payload)["stalled_s"] == 1.0
    begun = time.monotonic()
    answer = asyncio.create_task(completion(http, decode, max_tokens=4))
    async with http.get(f"{decode}/health") as resp:  # vLLM's API server is not the stopped EngineCore
        assert resp.status == 200
    assert not answer.done()
    assert len((await answer)["choices"][0]["text"].split()) == 4
    assert time.monotonic() - begun >= 0.9


async def test_a_restart_cuts_what_is_in_flight_and_comes_back_under_a_new_engine_id(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    prefill_url, decode_url = cluster.urls
    old_params = (await prefill(http, prefill_url, "before-restart"))["kv_transfer_params"]
    old_id = await engine_id(http, prefill_url)
    # A long answer streaming from prefill (it serves whole requests too) when it dies.
    body = {"model": PROFILE.served_model_name, "prompt": PROMPT, "max_tokens": 1000, "stream": True}
    async with http.post(f"{prefill_url}/v1/completions", json=body) as streaming:
        await streaming.content.readany()
        status, payload = await post(http, f"{prefill_url}/sim/restart", {"down_s": 0.5})
        restarted = orjson.loads(payload)
        assert status == 200 and restarted["engine_id"] == old_id != restarted["new_engine_id"]
        with pytest.raises(aiohttp.ClientPayloadError):
            while await streaming.content.readany():
                pass
    with pytest.raises(aiohttp.ClientConnectionError):  # nothing answers while it is "down"
        async with http.get(f"{prefill_url}/health") as resp:
            await resp.read()
    status, _ = await post(http, f"{prefill_url}/sim/restart", {"down_s": 0})
    assert status == 409
    await asyncio.sleep(0.7)
    assert await engine_id(http, prefill_url) == restarted["new_engine_id"]
    assert await metric(http, prefill_url, "vllm:request_success_total") == 0  # a new process's counters
    # Decode still holding the old engine's params fails at once, as vLLM's does (500, not a hang).
    begun = time.monotonic()
    failed_before = await metric(http, decode_url, "vllm:nixl_num_failed_transfers_total")
    status, payload = await post(
        http, f"{decode_url}/v1/completions", {"prompt": PROMPT, "kv_transfer_params": old_params}
    )
    assert status == 500 and orjson.loads(payload) == INTERNAL_ERROR
    assert time.monotonic() - begun < 2.0
    assert await metric(http, decode_url, "vllm:nixl_num_failed_transfers_total") == failed_before + 1
    new_params = (await prefill(http, prefill_url, "after-restart"))["kv_transfer_params"]
    assert new_params["remote_engine_id"] == restarted["new_engine_id"]
    answer = await completion(http, decode_url, max_tokens=4, kv_transfer_params=new_params)
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_a_heartbeat_over_http_keeps_a_lease_alive_past_its_end(
    cluster: SimCluster, http: aiohttp.ClientSession
) -> None:
    prefill_url = cluster.urls[0]
    params = (await prefill(http, prefill_url, "kept-alive"))["kv_transfer_params"]
    expired_before = (await stats(http, prefill_url))["num_kv_expired"]
    await asyncio.sleep(LEASE_S - 1.0)
    beat = {
        "remote_engine_id": params["remote_engine_id"],
        "remote_request_ids": [params["remote_request_id"]],
    }
    status, _ = await post(http, f"{prefill_url}/sim/kv/heartbeat", beat)
    assert status == 200
    await asyncio.sleep(1.4)  # past the lease, within the extension
    now = await stats(http, prefill_url)
    assert (now["num_held"], now["num_kv_expired"]) == (1, expired_before)
    for _ in range(60):  # then it runs out, about 2 s after the heartbeat
        if (await stats(http, prefill_url))["num_kv_expired"] == expired_before + 1:
            break
        await asyncio.sleep(0.05)
    assert (await stats(http, prefill_url))["num_kv_expired"] == expired_before + 1


@pytest.mark.parametrize(
    ("route", "body"),
    [("/sim/stall", {"seconds": -1}), ("/sim/stall", {}), ("/sim/restart", {"down_s": "soon"}),
     ("/sim/kv/heartbeat", {"remote_engine_id": "x"})],
)  # fmt: skip
async def test_malformed_fault_requests_are_refused(
    cluster: SimCluster, http: aiohttp.ClientSession, route: str, body: dict[str, object]
) -> None:
    status, payload = await post(http, f"{cluster.urls[1]}{route}", body)
    assert status == 400 and orjson.loads(payload)["error"]["type"] == "BadRequestError"
