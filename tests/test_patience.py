"""The tools' wait for their own answers: as long as an instance's counters move, a stall named after a
stated time of nothing moving, and an overall limit however busy the system."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence

import pytest

from pdserve import httpclient, patience
from pdserve.errors import MetricsUnreadable, Stalled, Unreachable
from pdserve.patience import Patience, Patient, Reading, Waiting

DECODE = "decode http://127.0.0.1:8200"
PREFILL = "prefill http://127.0.0.1:8100"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _busy(tokens: float, running: float = 8, waiting: float = 14, name: str = DECODE) -> Reading:
    return Reading(name, running, waiting, tokens)


def test_moving_counters_keep_a_long_wait_going_and_standing_ones_stall_naming_the_instance() -> None:
    clock = FakeClock()
    patience = Patience(Waiting(stall_s=60, limit_s=1800), clock)
    for step in range(20):  # 10 minutes in 30 s steps, the counters moving: never a stall
        clock.now += 30
        patience.note([_busy(100.0 * step), Reading(PREFILL, 0, 0, 500.0)])
        assert patience.stall("verify-1") is None
    clock.now += 30
    patience.note([_busy(1900.0), Reading(PREFILL, 0, 0, 500.0)])
    assert patience.stall("verify-1") is None  # 30 s of nothing: under the stated 60
    clock.now += 31
    patience.note([_busy(1900.0), Reading(PREFILL, 0, 0, 500.0)])
    why = patience.stall("verify-1")
    assert why is not None
    assert "verify-1: stalled: nothing moved for 61 s" in why
    assert f"{DECODE} (running 8, waiting 14)" in why
    assert PREFILL not in why  # idle, so not the one holding it up


def test_the_overall_limit_ends_a_wait_however_busy_the_system() -> None:
    clock = FakeClock()
    patience = Patience(Waiting(stall_s=60, limit_s=300), clock)
    for step in range(10):
        clock.now += 30
        patience.note([_busy(float(step))])
    why = patience.stall("verify-1")
    assert why is not None and "no answer after 300 s, the overall limit (--max-wait)" in why


def test_the_proxys_view_counts_where_the_instance_cannot_be_read() -> None:
    clock = FakeClock()
    patience = Patience(Waiting(stall_s=60), clock)
    clock.now += 100
    patience.note([Reading(DECODE, 3, 5, None, lag_s=2.0)])  # it stepped 2 s ago, says the proxy
    assert patience.stall("r") is None
    clock.now += 100
    patience.note([Reading(DECODE, 3, 5, None, lag_s=102.0)])
    assert "stalled: nothing moved for 102 s" in (patience.stall("r") or "")


def test_an_unreadable_instance_is_no_news_and_says_so() -> None:
    clock = FakeClock()
    patience = Patience(Waiting(stall_s=60), clock)
    clock.now += 61
    patience.note([Reading(DECODE)])
    assert f"{DECODE} (its queue unreadable)" in (patience.stall("r") or "")


def test_queued_behind_others_is_said_with_the_queue() -> None:
    clock = FakeClock()
    patience = Patience(Waiting(), clock)
    clock.now += 40
    patience.note([_busy(1.0), Reading(PREFILL, 1, 0, 2.0)])
    assert patience.still_waiting("verify-1") == (
        f"verify-1: queued behind 21 other request(s) at {DECODE} (running 8, waiting 14); "
        "still waiting, 40 s so far"
    )


def _patient(
    source: Callable[[], Sequence[Reading]], clock: FakeClock, said: list[str], **kw: float
) -> Patient:
    waiting = Waiting(stall_s=kw.get("stall_s", 60), limit_s=1800, poll_s=0.001, say_every_s=20)
    return Patient(source, waiting, said.append, clock)


def test_a_queued_request_is_waited_for_and_its_answer_returned() -> None:
    clock, said = FakeClock(), []
    tokens = [0.0]
    answer = threading.Event()

    def source() -> list[Reading]:
        clock.now += 10  # each reading 10 s on
        tokens[0] += 5
        if clock.now - 1000 >= 600:  # answered after 10 minutes of queueing
            answer.set()
        return [_busy(tokens[0])]

    def call() -> httpclient.Response:
        answer.wait(30)
        return httpclient.Response(200, {}, b"{}")

    response = _patient(source, clock, said).call(call, "verify-1")
    assert response.status == 200
    assert said and all("verify-1: queued behind 21 other request(s)" in line for line in said)


def test_nothing_moving_stalls_a_request_that_never_answers() -> None:
    clock, said = FakeClock(), []
    release = threading.Event()

    def source() -> list[Reading]:
        clock.now += 10
        return [_busy(42.0)]

    def call() -> httpclient.Response:
        release.wait(30)
        return httpclient.Response(200, {}, b"{}")

    try:
        with pytest.raises(Stalled, match=f"verify-1: stalled: nothing moved for 60 s .* at {DECODE}"):
            _patient(source, clock, said).call(call, "verify-1")
    finally:
        release.set()


def test_a_refused_connection_is_still_cannot_reach() -> None:
    clock, said = FakeClock(), []

    def call() -> httpclient.Response:
        raise Unreachable("cannot reach http://127.0.0.1:9/v1/completions: Connection refused")

    with pytest.raises(Unreachable, match="cannot reach"):
        _patient(lambda: [], clock, said).call(call, "verify-1")


def test_where_this_host_cannot_read_an_instance_the_proxys_instances_view_stands_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listing = [
        {"role": "prefill", "url": "http://10.0.0.1:8100", "running": 0, "waiting": 0, "lag_s": 0.0},
        {"role": "decode", "url": "http://10.0.0.2:8200", "running": 8, "waiting": 14, "lag_s": 3.5},
    ]

    def request(url: str, **_kw: object) -> httpclient.Response:
        assert url == "http://proxy:8000/instances"
        return httpclient.Response(200, {}, json.dumps(listing).encode())

    def firewalled(url: str, timeout: float) -> dict[str, float]:
        raise MetricsUnreadable(f"cannot read {url}/metrics: timed out")

    monkeypatch.setattr(httpclient, "request", request)
    monkeypatch.setattr(patience, "scrape", firewalled)
    readings = patience.proxy_readings("http://proxy:8000")()
    assert readings == [
        Reading("prefill http://10.0.0.1:8100", 0, 0, None, 0.0),
        Reading("decode http://10.0.0.2:8200", 8, 14, None, 3.5),
    ]


def test_a_request_sent_straight_to_one_instance_stalls_with_it_however_busy_the_others() -> None:
    clock = FakeClock()
    other = "decode http://127.0.0.1:8201"
    patience = Patience(Waiting(stall_s=60), clock, target="http://127.0.0.1:8200/v1/completions")
    for step in range(3):
        clock.now += 31
        patience.note([_busy(7.0), _busy(100.0 * step, name=other)])
    why = patience.stall("verify-1-oracle") or ""
    assert f"nothing moved for 93 s (--stall-after 60) at {DECODE} (running 8, waiting 14):" in why
    assert other not in why
