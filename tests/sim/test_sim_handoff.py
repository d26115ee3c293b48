"""The NixlConnector handoff between sim instances, as vLLM does it: prefill's kv_transfer_params,
decode's pull (in-process and over HTTP), held blocks, leases, late pulls and failed pulls."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from sim_rig import (
    INTERNAL_ERROR,
    PREFILL_PARAMS,
    PROFILE,
    PROMPT,
    STREAM_ERROR,
    Sims,
    completion,
    events,
    metric,
    post,
    prefill,
    stats,
)

from pdserve.engines.logwatch import parse_line
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread

KV_PARAMS_KEYS = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                  "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                  "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
                  "remote_prefill_cached_tokens"]  # fmt: skip


async def test_prefill_then_decode_hands_the_kv_over(sims: Sims, http: aiohttp.ClientSession) -> None:
    pulls_before = await metric(http, sims.decode, "vllm:nixl_xfer_time_seconds_count")
    answer = await prefill(http, sims.prefill, "pd1")
    params = answer["kv_transfer_params"]
    assert list(params) == KV_PARAMS_KEYS
    prefill_port = int(sims.prefill.rsplit(":", 1)[1])
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == prefill_port
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert params["transfer_mode"] == "pull" and params["remote_blocks_expiry_time"] is None
    assert re.fullmatch(r"cmpl-pd1-0-[0-9a-f]{8}", params["remote_request_id"])
    assert params["remote_num_tokens"] == answer["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == 1 and params["remote_block_ids"][0]
    held = await stats(http, sims.prefill)
    assert held["num_held"] >= 1 and held["kv_usage"] > 0  # prefill holds the blocks until decode pulls

    decoded = await completion(http, sims.decode, max_tokens=8, kv_transfer_params=params)
    direct = await completion(http, sims.both, max_tokens=8)
    assert decoded["choices"][0]["text"] == direct["choices"][0]["text"]  # greedy P→D == one instance
    assert decoded["choices"][0]["text"].startswith(answer["choices"][0]["text"])
    assert decoded["kv_transfer_params"] is None
    assert await metric(http, sims.decode, "vllm:nixl_xfer_time_seconds_count") == pulls_before + 1
    assert (await stats(http, sims.prefill))["num_held"] == held["num_held"] - 1


async def test_chat_prefill_names_its_request_like_vllm(sims: Sims, http: aiohttp.ClientSession) -> None:
    req = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 1,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    status, payload = await post(http, f"{sims.prefill}/v1/chat/completions", req, **{"X-Request-Id": "pre2"})
    params = orjson.loads(payload)["kv_transfer_params"]
    assert status == 200 and re.fullmatch(r"chatcmpl-pre2-[0-9a-f]{8}", params["remote_request_id"])
    stream = {**req, "max_tokens": 4, "stream": True, "kv_transfer_params": params}
    status, payload = await post(http, f"{sims.decode}/v1/chat/completions", stream)
    _role, *chunks, done = events(payload)
    assert status == 200 and len(chunks) == 4 and done == b"[DONE]"


async def test_prefill_ending_on_a_stop_string_hands_nothing_over(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    first_word = (await completion(http, sims.both, max_tokens=1))["choices"][0]["text"]
    before = await stats(http, sims.prefill)
    answer = await prefill(http, sims.prefill, "stopped", stop=[first_word])
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["kv_transfer_params"] is None  # vLLM hands KV over only for length-finished prefills
    after = await stats(http, sims.prefill)
    # Earlier tests' unpulled handoffs may reach their lease in this prefill's step: those leave.
    expired = after["num_kv_expired"] - before["num_kv_expired"]
    assert after["num_held"] == before["num_held"] - expired


async def test_a_second_pull_of_the_same_kv_succeeds_with_wrong_text_like_vllm(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    params = (await prefill(http, sims.prefill, "twice"))["kv_transfer_params"]
    first = await completion(http, sims.decode, max_tokens=4, kv_transfer_params=params)
    failed_before = await metric(http, sims.decode, "vllm:nixl_num_failed_transfers_total")
    late_before = await metric(http, sims.prefill, "vllm:nixl_num_notifications_after_expiry_total")
    # The blocks went back to prefill after the first read: the second reads whatever they hold now.
    body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    second = await completion(http, sims.decode, **body)
    assert second["choices"][0]["text"] != first["choices"][0]["text"]
    assert await metric(http, sims.decode, "vllm:nixl_num_failed_transfers_total") == failed_before
    await prefill(http, sims.prefill, "twice-next")  # prefill reads the late notification at a step
    late = await metric(http, sims.prefill, "vllm:nixl_num_notifications_after_expiry_total")
    assert late == late_before + 1


async def test_params_of_an_engine_id_not_served_fail_fast_like_vllm(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    answer = await prefill(http, sims.prefill, "renamed")
    await fails_as_vllm_fails_a_pull(
        http, sims.decode, {**answer["kv_transfer_params"], "remote_engine_id": "old"}
    )


async def fails_as_vllm_fails_a_pull(
    http: aiohttp.ClientSession, decode: str, params: dict[str, object]
) -> None:
    """``decode`` handed ``params`` answers as vLLM does when the pull fails: 500 whole, an error event
    streamed, each counted as a failed transfer."""
    failed_before = await metric(http, decode, "vllm:nixl_num_failed_transfers_total")
    body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    status, payload = await post(http, f"{decode}/v1/completions", body)
    assert status == 500 and orjson.loads(payload) == INTERNAL_ERROR
    status, payload = await post(http, f"{decode}/v1/completions", {**body, "stream": True})
    assert status == 200 and payload == b"data: " + STREAM_ERROR + b"\n\ndata: [DONE]\n\n"
    assert await metric(http, decode, "vllm:nixl_num_failed_transfers_total") == failed_before + 2


async def test_chat_stream_failing_its_pull_sends_the_role_chunk_first(
    sims: Sims, http: aiohttp.ClientSession
) -> None:
    params = {
        **(await prefill(http, sims.prefill, "gone"))["kv_transfer_params"],
        "remote_engine_id": "restarted-since",
    }
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "kv_transfer_params": params}
    status, payload = await post(http, f"{sims.decode}/v1/chat/completions", body)
    role, error, done = events(payload)
    assert status == 200 and role["choices"][0]["delta"]["role"] == "assistant"
    assert error == orjson.loads(STREAM_ERROR) and done == b"[DONE]"


@pytest.fixture(scope="module")
def short_lease() -> Iterator[list[str]]:
    """A prefill and a decode whose leases run out after 0.3 s."""
    profile = dataclasses.replace(PROFILE, kv_lease_s=0.3)
    with sim_in_thread([SimInstanceSpec("prefill"), SimInstanceSpec("decode")], profile) as cluster:
        yield cluster.urls


async def test_a_pull_after_the_lease_is_a_200_with_wrong_text_and_prefill_logs_both_lines(
    short_lease: list[str], http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's hazard (docs/vllm-kv-lifecycle.md, section 2): nothing in decode's answer shows it; only
    prefill's log lines and counters do, the late-pull one only once prefill steps again."""
    prefill_url, decode_url = short_lease
    first = (await prefill(http, prefill_url, "late1"))["kv_transfer_params"]
    second = (await prefill(http, prefill_url, "late2"))["kv_transfer_params"]
    assert (await stats(http, prefill_url))["num_held"] == 2
    await asyncio.sleep(0.6)
    expected = await completion(http, decode_url, max_tokens=4)  # decode alone: the right answer
    late = await completion(http, decode_url, max_tokens=4, kv_transfer_params=first)
    body = {"model": PROFILE.served_model_name, "prompt": PROMPT, "max_tokens": 4, "stream": True,
            "kv_transfer_params": second}  # fmt: skip
    status, payload = await post(http, f"{decode_url}/v1/completions", body)
    *chunks, done = events(payload)
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert status == 200 and done == b"[DONE]"
    assert expected["choices"][0]["text"] not in (late["choices"][0]["text"], streamed)
    assert await metric(http, decode_url, "vllm:nixl_xfer_time_seconds_count") == 2  # counted as transfers
    assert await metric(http, decode_url, "vllm:nixl_num_failed_transfers_total") == 0
    assert await metric(http, prefill_url, "vllm:nixl_num_kv_expired_reqs_total") == 2
    assert await metric(http, prefill_url, "vllm:kv_cache_usage_perc") == 0
    assert await metric(http, prefill_url, "vllm:nixl_num_notifications_after_expiry_total") == 0
    await prefill(http, prefill_url, "late3")
    assert await metric(http, prefill_url, "vllm:nixl_num_notifications_after_expiry_total") == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.sim"]
    for params in (first, second):
        rid = params["remote_request_id"]
        assert any(parse_line(line) == ("expired", rid) for line in lines), lines
        assert any(parse_line(line) == ("late_pull", rid) for line in lines), lines


@pytest.fixture(scope="module")
def other_process() -> Iterator[str]:
    """A decode in a cluster of its own: its pulls from the session's prefill go over HTTP."""
    with sim_in_thread([SimInstanceSpec("decode")], PROFILE) as cluster:
        yield cluster.urls[0]


async def pulled_as_one_instance(http: aiohttp.ClientSession, sims: Sims, decode: str, tag: str) -> int:
    """A fresh prompt prefilled by the session's prefill and decoded by ``decode``, whose text must be
    one instance's alone; prefill's ``tp_size`` as its params said."""
    params = (await prefill(http, sims.prefill, tag))["kv_transfer_params"]
    decoded = await completion(http, decode, max_tokens=5, kv_transfer_params=params)
    direct = await completion(http, sims.both, max_tokens=5)
    assert decoded["choices"][0]["text"] == direct["choices"][0]["text"]
    return int(params["tp_size"])


async def test_decode_in_another_process_pulls_over_http(
    sims: Sims, other_process: str, http: aiohttp.ClientSession
) -> None:
    held = (await stats(http, sims.prefill))["num_held"]
    await pulled_as_one_instance(http, sims, other_process, "remote1")
    assert (await stats(http, sims.prefill))["num_held"] == held  # held for the pull, released after it
    assert await metric(http, other_process, "vllm:nixl_xfer_time_seconds_count") >= 1
    assert await metric(http, other_process, "vllm:nixl_bytes_transferred_sum") > 0


async def test_kv_pull_endpoint(sims: Sims, http: aiohttp.ClientSession) -> None:
    params = (await prefill(http, sims.prefill, "direct"))["kv_transfer_params"]
    held_before = (await stats(http, sims.prefill))["num_held"]
    pull = {"remote_engine_id": params["remote_engine_id"], "remote_request_id": params["remote_request_id"]}
    status, payload = await post(http, f"{sims.prefill}/sim/kv/pull", pull)
    held = orjson.loads(payload)
    assert status == 200 and held["block_ids"] == params["remote_block_ids"][0]
    assert held["num_tokens"] == params["remote_num_tokens"]
    while (await stats(http, sims.prefill))["num_held"] == held_before:  # released at prefill's next step
        await asyncio.sleep(0.01)
    status, payload = await post(http, f"{sims.prefill}/sim/kv/pull", pull)  # the blocks went back
    assert status == 200 and orjson.loads(payload)["is_intact"] is False
    status, _ = await post(http, f"{sims.prefill}/sim/kv/pull", {**pull, "remote_engine_id": "other"})
    assert status == 404
    status, _ = await post(http, f"{sims.prefill}/sim/kv/pull", b"{}")
    assert status == 400


@pytest.fixture(scope="module")
def tp2_decode() -> Iterator[str]:
    """A decode of tensor-parallel size 2, serving a model of 8 KV heads, in a cluster of its own."""
    profile = dataclasses.replace(PROFILE, tensor_parallel_size=2, num_kv_heads=8)
    with sim_in_thread([SimInstanceSpec("decode")], profile) as cluster:
        yield cluster.urls[0]


@pytest.fixture(scope="module")
def tp2_prefill() -> Iterator[str]:
    """A prefill of tensor-parallel size 2 serving the session's model (1 KV head: each rank a copy)."""
    profile = dataclasses.replace(PROFILE, tensor_parallel_size=2)
    with sim_in_thread([SimInstanceSpec("prefill")], profile) as cluster:
        yield cluster.urls[0]


async def test_a_decode_of_a_larger_tp_pulls_from_a_smaller_prefill_as_vllm_pairs_them(
    sims: Sims, tp2_decode: str, http: aiohttp.ClientSession
) -> None:
    assert await pulled_as_one_instance(http, sims, tp2_decode, "tp1-to-tp2") == 1
    assert await metric(http, tp2_decode, "vllm:nixl_xfer_time_seconds_count") >= 1


async def test_a_decode_refuses_a_prefill_tp_vllm_cannot_pair_as_its_failed_handshake_does(
    sims: Sims, tp2_prefill: str, http: aiohttp.ClientSession
) -> None:
    # Prefill TP2 of a 1-KV-head model holds that head on both ranks; vLLM reads no replicated KV into a
    # decode of TP1: its handshake fails, and with it the request, whole or streamed.
    params = (await prefill(http, tp2_prefill, "tp2-to-tp1"))["kv_transfer_params"]
    assert params["tp_size"] == 2
    held = (await stats(http, tp2_prefill))["num_held"]
    await fails_as_vllm_fails_a_pull(http, sims.decode, params)
    assert (await stats(http, tp2_prefill))["num_held"] == held  # nothing was read: held until the lease
