"""Injected faults: the spec and its seeded draws, then what a client of a faulty instance sees."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson
import pytest
from sim_rig import MODEL, PREFILL_PARAMS, Sims, metric, set_faults, stats

from pdserve.errors import ConfigError, ConnectionDropped
from pdserve.sim.faults import Faults, FaultSpec, RequestFault
from pdserve.sim.wire import DroppedConnectionFilter, Writer

BODY: dict[str, object] = {"model": MODEL, "prompt": "one two three four five six", "max_tokens": 8}
INTERNAL_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                            "code": 500}}  # fmt: skip


# --- The spec -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"error_rate": 1.5},
        {"hang_rate": -0.1},
        {"error_rate": 0.6, "drop_rate": 0.6},
        {"token_delay_s": -1},
        {"down": "yes"},
        {"seed": 1.5},
        {"error_rate": "half"},
    ],
)
def test_invalid_fault_specs_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        FaultSpec().updated(changes)


def test_updates_merge_and_unknown_fields_are_named() -> None:
    spec = FaultSpec(error_rate=0.1).updated({"down": True})
    assert spec == FaultSpec(error_rate=0.1, down=True)
    with pytest.raises(ConfigError, match=r"unknown fault fields \['eror_rate'\]; valid: .*error_rate"):
        spec.updated({"eror_rate": 1})


def test_draws_are_deterministic_for_a_seed_and_follow_the_rates() -> None:
    spec = FaultSpec(error_rate=0.2, hang_rate=0.1, drop_rate=0.1, seed=42)
    first, second = Faults(spec), Faults(spec)
    draws = [first.draw_request_fault() for _ in range(5000)]
    assert draws == [second.draw_request_fault() for _ in range(5000)]
    share = {fault: draws.count(fault) / len(draws) for fault in RequestFault}
    assert share[RequestFault.ERROR] == pytest.approx(0.2, abs=0.03)
    assert share[RequestFault.HANG] == pytest.approx(0.1, abs=0.03)
    assert share[RequestFault.DROP] == pytest.approx(0.1, abs=0.03)
    assert Faults().draw_request_fault() is RequestFault.NONE
    pulls = Faults(FaultSpec(pull_fail_rate=0.5, seed=1))
    assert 400 < sum(pulls.draw_pull_failure() for _ in range(1000)) < 600


def test_setting_a_spec_reseeds_the_draws() -> None:
    faults = Faults(FaultSpec(error_rate=0.5, seed=3))
    before = [faults.draw_request_fault() for _ in range(20)]
    faults.update({"seed": 3})
    assert [faults.draw_request_fault() for _ in range(20)] == before


# --- Over HTTP ------------------------------------------------------------------------------------------


async def test_faults_are_read_and_set_over_http(sims: Sims, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{sims.decode}/sim/faults") as resp:
        assert await resp.json() == FaultSpec().to_mapping()
    assert (await set_faults(http, sims.decode, error_rate=0.25))["error_rate"] == 0.25
    async with http.post(f"{sims.decode}/sim/faults", json={"error_rate": 2}) as resp:
        assert resp.status == 400 and "error_rate" in (await resp.json())["error"]["message"]
    async with http.post(f"{sims.decode}/sim/faults", data=b"[1]") as resp:
        assert resp.status == 400


async def test_error_rate_answers_vllms_internal_error(sims: Sims, http: aiohttp.ClientSession) -> None:
    await set_faults(http, sims.decode, error_rate=1.0)
    async with http.post(f"{sims.decode}/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status == 500 and await resp.json() == INTERNAL_ERROR
    await set_faults(http, sims.decode, error_rate=0.5, seed=11)
    statuses = []
    for _ in range(40):
        async with http.post(f"{sims.decode}/v1/completions", json=BODY) as resp:
            statuses.append(resp.status)
    assert {200, 500} == set(statuses) and 10 < statuses.count(500) < 30
    await set_faults(http, sims.decode, seed=11)  # the same seed: the same requests fail
    again = []
    for _ in range(40):
        async with http.post(f"{sims.decode}/v1/completions", json=BODY) as resp:
            again.append(resp.status)
    assert again == statuses


async def test_hung_request_never_answers_and_is_aborted_on_hang_up(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    await set_faults(http, sims.decode, hang_rate=1.0)
    with pytest.raises(asyncio.TimeoutError):
        await http.post(f"{sims.decode}/v1/completions", json=BODY, timeout=aiohttp.ClientTimeout(total=0.3))
    assert (await stats(http, sims.decode))["num_running"] == 0
    async with http.get(f"{sims.decode}/health") as resp:  # only generation hangs
        assert resp.status == 200


async def test_dropped_stream_ends_without_done(sims: Sims, http: aiohttp.ClientSession) -> None:
    await set_faults(http, sims.decode, drop_rate=1.0)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{sims.decode}/v1/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                received += chunk
    assert received.count(b'"text"') == 8 // 2  # half the tokens, then the connection died
    assert b"[DONE]" not in received


async def test_dropped_answer_is_cut_mid_body(sims: Sims, http: aiohttp.ClientSession) -> None:
    await set_faults(http, sims.decode, drop_rate=1.0)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{sims.decode}/v1/completions", json=BODY) as resp:
            assert resp.status == 200
            await resp.read()
    await set_faults(http, sims.decode, drop_rate=0.0)
    async with http.post(f"{sims.decode}/v1/completions", json=BODY) as resp:  # the instance lives on
        assert resp.status == 200


async def test_token_delay_slows_every_token(sims: Sims, http: aiohttp.ClientSession) -> None:
    await set_faults(http, sims.decode, token_delay_s=0.02)
    start = time.perf_counter()
    async with http.post(f"{sims.decode}/v1/completions", json=BODY) as resp:
        assert resp.status == 200
    assert time.perf_counter() - start >= 8 * 0.02


async def test_down_instance_closes_connections_until_brought_back(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    await set_faults(http, sims.decode, down=True)
    for method, path in (("GET", "/health"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with http.request(method, f"{sims.decode}{path}", json=BODY) as resp:
                await resp.read()
    async with http.get(f"{sims.decode}/sim/faults") as resp:  # the control plane stays up
        assert (await resp.json())["down"] is True
    await set_faults(http, sims.decode, down=False)
    async with http.get(f"{sims.decode}/health") as resp:
        assert resp.status == 200


async def test_pull_failures_fail_decode_and_leave_prefill_holding(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    req = {**BODY, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    async with http.post(f"{sims.prefill}/v1/completions", json=req) as resp:
        params = (await resp.json())["kv_transfer_params"]
    held = (await stats(http, sims.prefill))["num_held"]
    failed = await metric(http, sims.decode, "vllm:nixl_num_failed_transfers_total")
    await set_faults(http, sims.decode, pull_fail_rate=1.0)
    async with http.post(
        f"{sims.decode}/v1/completions", json={**BODY, "kv_transfer_params": params}
    ) as resp:
        assert resp.status == 500 and await resp.json() == INTERNAL_ERROR
    assert await metric(http, sims.decode, "vllm:nixl_num_failed_transfers_total") == failed + 1
    assert (await stats(http, sims.prefill))["num_held"] == held  # still held, until its lease runs out
    await set_faults(http, sims.decode, pull_fail_rate=0.0)
    async with http.post(
        f"{sims.decode}/v1/completions", json={**BODY, "kv_transfer_params": params}
    ) as resp:
        assert resp.status == 200  # a retry can still read it


async def test_a_down_prefill_cannot_serve_pulls(sims: Sims, http: aiohttp.ClientSession) -> None:
    req = {**BODY, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    async with http.post(f"{sims.prefill}/v1/completions", json=req) as resp:
        params = orjson.loads(await resp.read())["kv_transfer_params"]
    await set_faults(http, sims.prefill, down=True)
    async with http.post(
        f"{sims.decode}/v1/completions", json={**BODY, "kv_transfer_params": params}
    ) as resp:
        assert resp.status == 500
    await set_faults(http, sims.prefill, down=False)


def test_without_a_transport_a_drop_is_left_to_the_server() -> None:
    async def send(message: object) -> None:
        raise AssertionError("nothing is sent")

    with pytest.raises(ConnectionDropped):
        Writer(send).drop()
    exc = ConnectionDropped()
    record = logging.LogRecord("uvicorn.error", logging.ERROR, "", 0, "Exception in ASGI application", None,
                               (ConnectionDropped, exc, None))  # fmt: skip
    assert not DroppedConnectionFilter().filter(record)  # an injected drop is not logged as a crash
