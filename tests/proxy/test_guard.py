"""The lease guard: an answer that may rest on KV prefill already released never reaches the client;
the request is prefilled again. In memory (memory_upstream.py), with a short lease and slow decodes."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from memory_upstream import Answer, Script
from test_flow_memory import COMPLETION, PARAMS, System, decode_text, prefill_ok

from pdserve import sse
from pdserve.config import Timeouts
from pdserve.configparts import Retries
from pdserve.events import KVLogEvent
from pdserve.proxy.pool.health import HealthChecker

LEASE_S = 2.0  # the guard's margin is 1 s: an answer past 1 s after prefill's is "past the lease"


def slow_first(text: str, delay_s: float) -> Script:
    """A decode whose first answer comes only after ``delay_s`` (stalled or queued), then at once."""
    fast = decode_text(text)
    calls: list[int] = []

    def answer(body: dict[str, Any]) -> Answer:
        calls.append(1)
        quick = fast(body)
        if len(calls) > 1:
            return quick
        return Answer(quick.status, quick.body, quick.chunks, quick.content_type, delay_s=delay_s)

    return answer


def expired_metrics(count: int) -> str:
    return f'vllm:nixl_num_kv_expired_reqs_total{{engine="0"}} {count}.0\n'


async def scraped(system: System, expired: int) -> None:
    """The health checker has read prefill's lease counter (the baseline the guard compares with)."""
    system.upstreams["http://p0:1"].metrics = expired_metrics(expired)
    checker = HealthChecker(system.state, interval_s=1, timeout_s=1)
    await checker.check_all()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_past_the_lease_while_prefill_released_leases_is_not_relayed(stream: bool) -> None:
    system = System([prefill_ok], [slow_first(" right", 1.3)], kv_lease_s=LEASE_S)
    await scraped(system, expired=4)
    system.upstreams["http://p0:1"].metrics = expired_metrics(5)  # a lease ran out meanwhile
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 200
    assert b" right" in answer.body
    assert len(system.calls("http://p0:1")) == 2  # prefilled again
    assert len(system.calls("http://d0:1")) == 2  # and only the second answer reached the client
    assert system.state.ledger.suspects["late"] == 1
    assert system.state.stats.retries["lease"] == 1
    first, redo = system.calls("http://d0:1")
    # The redo misses the late pull's blocks in decode's prefix cache, which is reset for later requests.
    assert "cache_salt" not in first and redo["cache_salt"].startswith("pdserve-lease-retry-")
    assert redo["cache_salt"] == system.calls("http://p0:1")[1]["cache_salt"]  # the same hashes on both
    assert system.upstreams["http://d0:1"].num_prefix_resets == 1
    assert system.state.stats.purges["ok"] == 1


async def test_a_late_answer_is_trusted_when_no_lease_ran_out_on_prefill() -> None:
    # A long queue at decode is normal: its heartbeats keep the lease alive, and prefill says so by
    # not counting an expiry.
    system = System([prefill_ok], [slow_first(" queued", 1.3)], kv_lease_s=LEASE_S)
    await scraped(system, expired=4)
    answer = await system.ask(COMPLETION)
    assert answer.status == 200 and b" queued" in answer.body
    assert len(system.calls("http://p0:1")) == 1
    assert system.state.ledger.suspects == {}


async def test_prefills_log_saying_it_released_the_kv_discredits_even_a_quick_answer() -> None:
    ids = iter(range(100))

    def prefill_fresh_ids(body: dict[str, Any]) -> Answer:  # vLLM names every prefill anew
        params = {**PARAMS, "remote_request_id": f"cmpl-r-0-{next(ids):08x}"}
        return Answer(body=orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": params}))

    system = System([prefill_fresh_ids], [decode_text(" ok")], kv_lease_s=30)
    event = KVLogEvent("http://p0:1", "expired", "cmpl-r-0-00000000", at=0.0)

    def decode_after_release(body: dict[str, Any]) -> Answer:
        if len(system.calls("http://d0:1")) == 1:
            system.state.on_event(event)  # the log watcher read the line while decode was pulling
        return decode_text(" ok")(body)

    system.upstreams["http://d0:1"].script = decode_after_release
    answer = await system.ask(COMPLETION)
    assert answer.status == 200 and b" ok" in answer.body
    assert len(system.calls("http://p0:1")) == 2  # the released handoff was replaced by a fresh one
    assert system.state.ledger.suspects["log"] == 1


async def test_the_requests_deadline_bounds_all_its_attempts() -> None:
    system = System([prefill_ok], [slow_first(" never", 2.0)], timeouts=Timeouts(request=0.5))
    answer = await system.ask(COMPLETION)
    assert answer.status == 504
    assert "deadline" in orjson.loads(answer.body)["error"]["message"]


async def test_prompt_logprobs_are_served_by_decode_alone() -> None:
    system = System([prefill_ok], [decode_text(" alone")])
    answer = await system.ask({**COMPLETION, "echo": True, "logprobs": 1})
    assert answer.status == 200
    assert system.calls("http://p0:1") == []
    assert "kv_transfer_params" not in system.calls("http://d0:1")[0]


def prefill_fresh_ids() -> Script:
    """A prefill that names every request's KV anew, as vLLM does (``remote_request_id``)."""
    ids = iter(range(1000))

    def answer(body: dict[str, Any]) -> Answer:
        params = {**PARAMS, "remote_request_id": f"cmpl-r-0-{next(ids):08x}"}
        return Answer(body=orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": params}))

    return answer


def released(system: System, body: dict[str, Any]) -> None:
    """Prefill's log says it released the KV this decode request carries (the log watcher's event)."""
    rid = body["kv_transfer_params"]["remote_request_id"]
    system.state.on_event(KVLogEvent("http://p0:1", "expired", rid, at=0.0))


async def test_answers_that_rest_on_released_kv_every_time_are_served_by_decode_computing_the_prompt() -> (
    None
):
    system = System([prefill_fresh_ids()], [decode_text(" wrong")], kv_lease_s=30)

    def released_unless_whole(body: dict[str, Any]) -> Answer:
        if "kv_transfer_params" not in body:
            return decode_text(" right")(body)  # computed from the prompt: no KV to have lost
        released(system, body)
        return decode_text(" wrong")(body)

    system.upstreams["http://d0:1"].script = released_unless_whole
    answer = await system.ask(COMPLETION)
    assert answer.status == 200
    assert b" right" in answer.body and b" wrong" not in answer.body
    assert len(system.calls("http://p0:1")) == 3  # the first prefill and two fresh ones, then no more
    decode_calls = system.calls("http://d0:1")
    assert "kv_transfer_params" not in decode_calls[-1]
    assert decode_calls[-1]["cache_salt"] not in {c.get("cache_salt") for c in decode_calls[:-1]}
    assert system.state.ledger.suspects["log"] == 3


async def test_answers_that_rest_on_released_kv_every_time_end_in_a_502_naming_the_lease() -> None:
    system = System(
        [prefill_fresh_ids()], [decode_text(" wrong")], kv_lease_s=30,
        retries=Retries(first_backoff_s=0, fallback_to_local_prefill=False),
    )  # fmt: skip

    def always_released(body: dict[str, Any]) -> Answer:
        released(system, body)
        return decode_text(" wrong")(body)

    system.upstreams["http://d0:1"].script = always_released
    answer = await system.ask(COMPLETION)
    assert answer.status == 502
    message = orjson.loads(answer.body)["error"]["message"]
    assert "KV lease" in message and "after 2 fresh prefills" in message
    assert b" wrong" not in answer.body
    assert len(system.calls("http://p0:1")) == 3  # the first prefill and two fresh ones
    assert system.state.ledger.suspects["log"] == 3


async def test_a_stream_prefills_log_discredits_midway_ends_with_an_error_naming_the_lease() -> None:
    system = System([prefill_fresh_ids()], [decode_text(" x")], kv_lease_s=30)
    text = [sse.event(orjson.dumps({"choices": [{"text": t}]})) for t in (" one", " two")]

    def discredited_after_first_chunk(body: dict[str, Any]) -> Answer:
        def before(i: int) -> None:
            if i == 1:  # the client has the first chunk; then the log watcher reads the release
                released(system, body)

        return Answer(chunks=[*text, sse.DONE], content_type="text/event-stream", before_chunk=before)

    system.upstreams["http://d0:1"].script = discredited_after_first_chunk
    answer = await system.ask({**COMPLETION, "stream": True})
    assert answer.status == 200  # the stream had begun
    assert b" one" in answer.body
    events = list(sse.payloads(answer.body))
    assert events[-1] == b"[DONE]"
    error = orjson.loads(events[-2])["error"]["message"]
    assert "KV lease" in error and "this answer may be wrong" in error
    assert system.state.ledger.suspects["log_during_stream"] == 1
    assert system.upstreams["http://d0:1"].num_prefix_resets == 1


async def test_prefills_log_speaking_after_an_answer_went_out_is_counted_as_suspect() -> None:
    system = System([prefill_fresh_ids()], [decode_text(" out")], kv_lease_s=30)
    answer = await system.ask(COMPLETION)
    assert answer.status == 200
    released(system, system.calls("http://d0:1")[0])
    assert system.state.ledger.suspects["log_after_delivery"] == 1


async def _route_of_third(system: System, first: dict[str, Any], wait_s: float) -> str:
    """Send ``first`` (round robin: to d0), then a quick one (d1), then after ``wait_s`` a third, which
    round robin would give d0 again: where did the third go?"""
    stuck = asyncio.create_task(system.ask(first))
    await asyncio.sleep(0.05)
    assert (await system.ask(COMPLETION)).status == 200  # d1
    await asyncio.sleep(wait_s)
    third = {**COMPLETION, "prompt": "third"}
    assert (await system.ask(third)).status == 200
    where = next(url for url in ("http://d0:1", "http://d1:1") if third["prompt"] in
                 [c.get("prompt") for c in system.calls(url)])  # fmt: skip
    await stuck
    return where


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_decode_whose_engine_shows_no_progress_gets_no_new_handoff(stream: bool) -> None:
    # Lease 3 s: a decode silent for a third of it (1 s) is not stepping, so it sends no heartbeats.
    system = System([prefill_ok], [slow_first(" late", 2.5), decode_text(" ok")], kv_lease_s=3)
    where = await _route_of_third(system, {**COMPLETION, "stream": stream}, wait_s=1.2)
    assert where == "http://d1:1"
    lagging = next(i for i in system.state.describe() if i["url"] == "http://d0:1")
    assert lagging["lag_s"] == 0  # its request is answered: nothing owed any more


async def test_a_busy_decode_whose_token_counters_move_still_gets_handoffs() -> None:
    system = System([prefill_ok], [slow_first(" long", 2.5), decode_text(" ok")], kv_lease_s=3)
    checker = HealthChecker(system.state, interval_s=1, timeout_s=1)
    d0 = system.upstreams["http://d0:1"]

    async def generating() -> None:  # the health checker's scrapes see d0's engine count tokens
        for n in range(12):
            d0.metrics = f'vllm:generation_tokens_total{{engine="0"}} {n}.0\n'
            await checker.check_all()
            await asyncio.sleep(0.1)

    scrapes = asyncio.create_task(generating())
    where = await _route_of_third(system, COMPLETION, wait_s=1.2)
    await scrapes
    assert where == "http://d0:1"
