"""pdserve's load generator (bench/load.py) against the simulator: what one request brings back, streamed
or whole, hung up on or refused, and what a closed loop of them sums to."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdserve.bench.load import Job, run_load, send
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import load_profile

Served = tuple[aiohttp.ClientSession, str, str]  # a session, a simulated instance's URL, its model


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    with sim_in_thread([SimInstanceSpec("both")], load_profile("zero")) as cluster:
        url = cluster.urls[0]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            yield http, url, model


def _job(model: str, stream: bool, max_tokens: int = 8, chat: bool = False) -> Job:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        return Job("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "the mill"}]})
    return Job(
        "/v1/completions", {**body, "prompt": "the river carried the boat"}, {"X-Request-Id": "load-1"}
    )


async def test_a_streamed_and_a_whole_answer_bring_back_the_same_greedy_text(served: Served) -> None:
    http, url, model = served
    for chat in (False, True):
        whole = await send(http, url, _job(model, False, chat=chat))
        streamed = await send(http, url, _job(model, True, chat=chat))
        assert whole.ok and streamed.ok and whole.status == streamed.status == 200
        assert whole.text and whole.text == streamed.text
        num_chunks = 8 + chat  # a chat stream's first chunk carries only the role, as vLLM's does
        assert (
            streamed.num_chunks == num_chunks and len(streamed.itls) == num_chunks - 1 and streamed.ttft > 0
        )


async def test_a_client_that_hangs_up_keeps_the_start_of_the_answer(served: Served) -> None:
    http, url, model = served
    full = await send(http, url, _job(model, True, max_tokens=16))
    cut = await send(http, url, _job(model, True, max_tokens=16), hang_up_after=2)
    assert cut.is_hung_up and not cut.ok and cut.num_chunks == 2
    assert full.text.startswith(cut.text) and len(cut.text) < len(full.text)


async def test_a_refused_request_says_its_status_and_vllms_message(served: Served) -> None:
    http, url, model = served
    for stream in (False, True):
        refused = await send(http, url, _job(model, stream, max_tokens=-1))
        assert not refused.ok and refused.status == 400
        assert refused.error is not None and "max_tokens" in refused.error and "b'" not in refused.error
        assert refused.why == f"HTTP 400: {refused.error}"


async def test_an_unreachable_server_is_a_failed_request_not_an_exception() -> None:
    async with aiohttp.ClientSession() as http:
        gone = await send(http, "http://127.0.0.1:1", Job("/v1/completions", {"stream": True}), timeout=5)
    assert not gone.ok and gone.status == 0 and not gone.is_timed_out and gone.error


async def test_a_closed_loop_streams_every_job_and_counts_each(served: Served) -> None:
    _, url, model = served
    summary, outcomes = await run_load(url, [_job(model, False)] * 6, concurrency=3)
    assert (summary.num_ok, summary.num_failed, len(outcomes)) == (6, 0, 6)
    assert all(o.num_chunks == 8 for o in outcomes)  # streamed although the jobs asked for whole answers
