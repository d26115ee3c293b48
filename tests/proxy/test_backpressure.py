"""Back-pressure from decode to prefill (proxy/pool/backpressure.py): a request is prefilled only when its
decode will renew the KV's lease in time (handoffs reach its engine soon, its scheduler steps), judged
from streams' way in and gaps between tokens and from how long decode has been silent; otherwise it
waits, first come first served, at most --max-decode-wait (then 503).

The rule on a hand-moved clock with stand-in decodes; the wait as the flow awaits it; then through a
running proxy in front of fakes: the wait bounded, its 503 past the limit, and both visible in /metrics
and /requests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from fake_vllm import FakeVLLM
from proxy_rig import STRICT, running_proxy, serve_fake
from test_flow import COMPLETION, post

from pdserve.cli import build_parser
from pdserve.commands.flags import admission_from_args
from pdserve.configparts import AdmissionLimits
from pdserve.errors import ConfigError, DecodeBacklogged, UpstreamTimeout
from pdserve.prometheus import parse_samples
from pdserve.proxy.pool.backpressure import NO_TICKET, Backpressure
from pdserve.proxy.pool.breaker import CircuitBreaker
from pdserve.proxy.pool.instance import EngineLoad, Instance
from pdserve.proxy.record.timeline import Timeline
from pdserve.proxy.serving.peers import merge_metrics

LEASE_S = 8.0  # budget: half of it, 4 s; vLLM heartbeats every 8 // 6 = 1 s at most
SCRAPE_S = 2.0  # the proxy's /metrics interval: a stepping decode may look silent this long


@dataclass
class Clock:
    t: float = 100.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Decode:
    """What the rule reads of a decode instance: its URL and how long it has shown no sign of stepping."""

    url: str = "http://decode-0"
    silent: float = 0.0

    def silence_s(self, now: float) -> float:
        return self.silent


def _gate(max_wait_s: float = 30.0) -> tuple[Backpressure, Clock, Decode]:
    clock = Clock()
    return Backpressure(LEASE_S, max_wait_s, clock, scrape_every_s=SCRAPE_S), clock, Decode()


def _stream(clock: Clock, gap_s: float, num_tokens: int = 4) -> Timeline:
    """A stream's timeline as decode relayed it: its first byte, then a token every ``gap_s``."""
    timeline = Timeline(clock.t)
    timeline.decode_first_byte = clock.t
    for i in range(num_tokens):
        timeline.chunk(clock.t + 0.001 + i * gap_s)
    return timeline


def _measure(bp: Backpressure, clock: Clock, decode: Decode, gap_s: float) -> None:
    """One streamed handoff alone at decode whose status line came at once and whose tokens came
    ``gap_s`` apart (decode's scheduler stepped that often)."""
    ticket = bp.admit(decode)  # type: ignore[arg-type]
    assert ticket is not None
    ticket.kv_arrived(is_stream=True)
    ticket.reached()
    ticket.began()
    ticket.ended(_stream(clock, gap_s))


# --- The rule ------------------------------------------------------------------------------------------


def test_with_nothing_measured_every_request_is_prefilled_at_once() -> None:
    bp, _, decode = _gate()
    tickets = [bp.admit(decode) for _ in range(50)]  # type: ignore[arg-type]
    assert all(t is not None and t.is_held for t in tickets)
    assert bp.intake(decode).num_ahead == 50  # type: ignore[arg-type]


def test_a_busy_decode_that_steps_admits_everyone_however_long_its_queue() -> None:
    bp, clock, decode = _gate()
    _measure(bp, clock, decode, 0.2)  # a step every 0.2 s
    queued = [bp.admit(decode) for _ in range(40)]  # type: ignore[arg-type]
    for ticket in queued:
        assert ticket is not None
        ticket.kv_arrived(is_stream=True)
        ticket.reached()  # decode's engine has it: its heartbeats keep the lease from here
    clock.t += 30.0  # forty first tokens still to come, 30 s on: a long queue, a lease kept alive
    decode.silent = SCRAPE_S  # the last scrape showed tokens moving
    assert all(bp.admit(decode) is not None for _ in range(10))  # type: ignore[arg-type]


def test_a_stalled_decode_holds_requests_at_the_proxy() -> None:
    bp, clock, decode = _gate()
    _measure(bp, clock, decode, 0.2)
    first = bp.admit(decode)  # type: ignore[arg-type]
    assert first is not None
    first.kv_arrived(is_stream=True)
    first.reached()
    decode.silent = SCRAPE_S + 2.0  # no token, first byte or answer for 4 s: its engine does not step
    assert bp.admit(decode) is None  # type: ignore[arg-type]
    assert "steps ~2.0 s apart" in bp.intake(decode).why()  # type: ignore[arg-type]
    decode.silent = 0.0  # it stepped again
    assert bp.admit(decode) is not None  # type: ignore[arg-type]


def test_a_decode_whose_steps_come_seconds_apart_holds_requests_at_the_proxy() -> None:
    bp, clock, decode = _gate()
    _measure(bp, clock, decode, 0.1)
    for _ in range(8):  # streams whose tokens came 5 s apart: its heartbeats would too
        _measure(bp, clock, decode, 5.0)
    assert bp.admit(decode) is not None  # type: ignore[arg-type]  # nothing ahead: one always goes
    assert bp.admit(decode) is None  # type: ignore[arg-type]


def test_requests_are_prefilled_while_handoffs_reach_decode_well_within_the_lease() -> None:
    bp, clock, decode = _gate()
    admitted = [bp.admit(decode)]  # type: ignore[arg-type]
    first = admitted[0]
    assert first is not None
    first.kv_arrived(is_stream=True)  # decode's status line does not come: its API server is slow
    clock.t += 2.5  # 2.5 s on its way, 1 s to a heartbeat: 3.5 s within the 4 s budget
    admitted.append(bp.admit(decode))  # type: ignore[arg-type]
    clock.t += 1.0  # 4.5 s past it
    admitted.append(bp.admit(decode))  # type: ignore[arg-type]
    assert [t is not None for t in admitted] == [True, True, False]
    first.began()  # it arrived and answered: it leaves the queue
    assert bp.admit(decode) is not None  # type: ignore[arg-type]


def test_one_handoff_always_goes_however_slow_the_decode_was() -> None:
    bp, clock, decode = _gate()
    _measure(bp, clock, decode, 60.0)
    first = bp.admit(decode)  # type: ignore[arg-type]
    assert first is not None and bp.admit(decode) is None  # type: ignore[arg-type]
    first.release()
    assert bp.admit(decode) is not None  # type: ignore[arg-type]


def test_kv_waiting_past_the_budget_at_a_stalled_decode_holds_everything_else_back() -> None:
    bp, clock, decode = _gate()
    stuck = bp.admit(decode)  # type: ignore[arg-type]
    assert stuck is not None
    stuck.kv_arrived(is_stream=True)
    clock.t += 3.0
    assert bp.admit(decode) is not None  # type: ignore[arg-type]
    clock.t += 2.0  # its KV has waited 5 s and decode has not taken the request: nothing measured, no room
    assert bp.admit(decode) is None  # type: ignore[arg-type]
    assert "ahead" in bp.intake(decode).why()  # type: ignore[arg-type]


def test_a_long_whole_answer_holds_no_one_back_once_decode_has_its_kv() -> None:
    bp, clock, decode = _gate()
    _measure(bp, clock, decode, 1.5)
    whole = [bp.admit(decode) for _ in range(2)]  # type: ignore[arg-type]
    for ticket in whole:
        assert ticket is not None
        ticket.kv_arrived(is_stream=False)  # decoding for minutes now: its engine heartbeats it
    clock.t += 60.0
    assert bp.intake(decode).num_ahead == 0 and bp.admit(decode) is not None  # type: ignore[arg-type]


def test_a_stream_that_began_with_prefills_token_measures_no_gap_from_the_hand_over() -> None:
    bp, clock, decode = _gate()
    ticket = bp.admit(decode)  # type: ignore[arg-type]
    assert ticket is not None
    timeline = Timeline(clock.t)
    timeline.chunk(clock.t)  # the client had prefill's first token at once
    timeline.decode_first_byte = clock.t + 9.0  # decode's first came 9 s later, after its queue
    timeline.chunk(clock.t + 9.0)
    ticket.began()
    ticket.ended(timeline)
    assert bp.intake(decode).step_gap_s() == 0.0  # type: ignore[arg-type]


@dataclass
class FakeUpstream:
    url: str = "http://decode-0"
    role: str = "decode"


def test_an_engine_is_silent_only_while_requests_are_there_and_its_counters_stand_still() -> None:
    decode = Instance(FakeUpstream(), CircuitBreaker())  # type: ignore[arg-type]
    assert decode.silence_s(time.monotonic() + 60) == 0.0  # nothing there: nothing to judge
    decode.dispatch()  # one request there
    decode._progress_at -= 30  # half a minute without a sign of stepping
    assert decode.silence_s(time.monotonic()) >= 30
    decode.check_passed(EngineLoad(num_tokens=100.0))  # a scrape: its counters moved
    assert decode.silence_s(time.monotonic()) < 1
    decode._progress_at -= 30
    decode.check_passed(EngineLoad(num_tokens=100.0))  # they stood still
    assert decode.silence_s(time.monotonic()) >= 30
    decode.check_passed(EngineLoad(num_tokens=5.0))  # a restart put them back: it stepped
    assert decode.silence_s(time.monotonic()) < 1


def test_no_wait_when_the_limit_is_zero() -> None:
    bp, clock, decode = _gate(max_wait_s=0)
    _measure(bp, clock, decode, 60.0)
    assert all(bp.admit(decode) is NO_TICKET for _ in range(10))  # type: ignore[arg-type]


def test_the_wait_limit_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="max_decode_wait_s"):
        AdmissionLimits(max_decode_wait_s=-1)


# --- The wait ------------------------------------------------------------------------------------------


def _slow(bp: Backpressure, clock: Clock, decode: Decode) -> Any:
    """A decode measured at a step every 10 s, one handoff ahead: the next request waits."""
    _measure(bp, clock, decode, 10.0)
    ahead = bp.admit(decode)  # type: ignore[arg-type]
    assert ahead is not None and bp.admit(decode) is None  # type: ignore[arg-type]
    return ahead


async def test_waiters_go_first_come_first_served_as_handoffs_ahead_begin() -> None:
    bp, clock, decode = _gate()
    ahead = _slow(bp, clock, decode)
    far = time.monotonic() + 60
    first = asyncio.ensure_future(bp.wait(decode, far, 60))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    second = asyncio.ensure_future(bp.wait(decode, far, 60))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert bp.num_waiting == 2 and not first.done()
    clock.t += 1.0
    ahead.began()
    await asyncio.sleep(0.01)
    assert first.done() and not second.done()
    turn = first.result()
    assert turn.seconds == pytest.approx(1.0) and "decode http://decode-0" in turn.why
    turn.ticket.began()
    await asyncio.sleep(0.01)
    assert second.done() and bp.num_waiting == 0
    assert bp.results["admitted"] == 2 and bp.waits.count == 2


async def test_past_the_limit_the_request_hears_a_503_naming_the_wait_and_the_limit() -> None:
    bp, clock, decode = _gate(max_wait_s=0.2)
    _slow(bp, clock, decode)
    bp._now = time.monotonic  # real time for the wait itself
    with pytest.raises(DecodeBacklogged) as raised:
        await bp.wait(decode, time.monotonic() + 60, 60)  # type: ignore[arg-type]
    assert raised.value.status == 503 and raised.value.retry_after_s >= 1
    assert "waited 0.2 s" in str(raised.value) and "--max-decode-wait 0.2 s" in str(raised.value)
    assert bp.results["timed_out"] == 1 and bp.num_waiting == 0


async def test_the_request_deadline_ends_the_wait_as_a_timeout_of_its_own() -> None:
    bp, clock, decode = _gate(max_wait_s=30)
    _slow(bp, clock, decode)
    bp._now = time.monotonic
    with pytest.raises(UpstreamTimeout, match="deadline passed while it waited"):
        await bp.wait(decode, time.monotonic() + 0.1, 5)  # type: ignore[arg-type]


async def test_a_client_that_leaves_while_waiting_gives_its_turn_to_the_next() -> None:
    bp, clock, decode = _gate()
    ahead = _slow(bp, clock, decode)
    far = time.monotonic() + 60
    leaving = asyncio.ensure_future(bp.wait(decode, far, 60))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    staying = asyncio.ensure_future(bp.wait(decode, far, 60))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    leaving.cancel()
    await asyncio.sleep(0.01)
    ahead.release()
    await asyncio.sleep(0.01)
    assert staying.done() and bp.results["gone"] == 1
    assert bp.intake(decode).num_ahead == 1  # type: ignore[arg-type]


# --- Through the proxy ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _pair() -> Any:
    prefill, decode = FakeVLLM("prefill"), FakeVLLM("decode")
    with serve_fake(prefill) as prefill_url, serve_fake(decode) as decode_url:
        yield prefill, decode, prefill_url, decode_url


@pytest.fixture
def pair(_pair: Any) -> Any:
    for fake in _pair[:2]:
        fake.reset()
    return _pair


def _proxy(pair: Any, max_wait_s: float) -> Any:
    # A 2 s lease (1 s budget); decode owes a stream its first token for 2 s (the rig's TIMEOUTS).
    _, _, prefill_url, decode_url = pair
    return running_proxy([prefill_url], [decode_url], kv_lease_s=2.0, retries=STRICT,
                         admission=AdmissionLimits(max_decode_wait_s=max_wait_s))  # fmt: skip


async def _behind_a_stuck_stream(
    http: aiohttp.ClientSession, url: str, decode: FakeVLLM
) -> asyncio.Task[Any]:
    """A streamed request whose decode never answers, and its KV waiting past the 1 s budget."""
    decode.fault = "hang"
    stuck = asyncio.ensure_future(
        post(http, url + "/v1/completions", {**COMPLETION, "stream": True}, "stuck")
    )
    assert await asyncio.to_thread(decode.wait_for_request, "stuck", 5)
    decode.fault = None
    await asyncio.sleep(1.2)
    return stuck


def _metrics(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("result", "")): s.value for s in parse_samples(text)}


async def test_a_request_behind_a_stuck_decode_waits_its_limit_and_hears_503_unprefilled(pair: Any) -> None:
    prefill, decode, _, _ = pair
    with _proxy(pair, max_wait_s=0.5) as url:
        async with aiohttp.ClientSession() as http:
            stuck = await _behind_a_stuck_stream(http, url, decode)
            begun = time.monotonic()
            status, headers, body = await post(http, url + "/v1/completions", COMPLETION, "held")
            took = time.monotonic() - begun
            await stuck
            async with http.get(url + "/metrics") as resp:
                metrics = _metrics(await resp.text())
    assert status == 503 and 0.4 < took < 2.0, (status, took)
    error = orjson.loads(body)["error"]
    assert error["type"] == "decode_backlogged" and "Retry-After" in headers
    assert "waited 0.5 s" in error["message"] and "--max-decode-wait 0.5 s" in error["message"]
    assert [r.headers.get("x-request-id") for r in prefill.generations()] == ["stuck"]  # no KV for "held"
    assert metrics[("pdserve_decode_waits_total", "timed_out")] == 1
    assert metrics[("pdserve_decode_wait_seconds_count", "")] == 1


async def test_a_held_request_is_served_once_the_stream_ahead_ends_and_its_wait_is_on_record(
    pair: Any,
) -> None:
    prefill, decode, _, _ = pair
    with _proxy(pair, max_wait_s=10) as url:
        async with aiohttp.ClientSession() as http:
            stuck = await _behind_a_stuck_stream(http, url, decode)
            waiting = asyncio.ensure_future(post(http, url + "/v1/completions", COMPLETION, "held"))
            await asyncio.sleep(0.3)
            async with http.get(url + "/metrics") as resp:
                during = _metrics(await resp.text())
            status, _, body = await waiting
            await stuck  # its decode's first token never came: 504 after 2 s, which freed the turn
            async with http.get(url + "/metrics") as resp:
                after = _metrics(await resp.text())
            async with http.get(url + "/requests", params={"id": "held"}) as resp:
                record = (await resp.json())["requests"][0]
    assert during[("pdserve_decode_wait_waiting", "")] == 1
    assert status == 200 and orjson.loads(body)["choices"][0]["text"] == decode.text(5)
    assert after[("pdserve_decode_waits_total", "admitted")] == 1
    assert after[("pdserve_decode_wait_waiting", "")] == 0
    assert record["decode_wait"]["ms"] > 500 and "ahead" in record["decode_wait"]["why"]
    assert [r.headers.get("x-request-id") for r in prefill.generations()] == ["stuck", "held"]


def test_the_flag_sets_the_limit() -> None:
    parsed = build_parser().parse_args(
        ["proxy", "--prefill", "p:1", "--decode", "d:1", "--max-decode-wait", "7"]
    )
    assert admission_from_args(parsed).max_decode_wait_s == 7.0
    assert (
        admission_from_args(
            build_parser().parse_args(["proxy", "--prefill", "p:1", "--decode", "d:1"])
        ).max_decode_wait_s
        == AdmissionLimits().max_decode_wait_s
    )


def test_several_workers_estimates_of_one_decode_merge_to_the_most_cautious() -> None:
    def text(ahead: int, expected: float) -> str:
        return (f'# HELP pdserve_decode_handoffs_ahead h\n# TYPE pdserve_decode_handoffs_ahead gauge\n'
                f'pdserve_decode_handoffs_ahead{{url="d"}} {ahead}\n'
                f'# HELP pdserve_decode_expected_pull_seconds h\n# TYPE pdserve_decode_expected_pull_seconds gauge\n'
                f'pdserve_decode_expected_pull_seconds{{url="d"}} {expected}\n')  # fmt: skip

    merged = {s.name: s.value for s in parse_samples(merge_metrics([text(2, 1.5), text(3, 4.0)]))}
    assert merged == {"pdserve_decode_handoffs_ahead": 5, "pdserve_decode_expected_pull_seconds": 4.0}
