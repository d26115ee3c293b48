"""verify on a slow simulated pair that other clients keep saturated: it waits its turn in decode's
queue, says so, passes and names its own requests; a pair whose decode stops stepping fails with a
stall that names it, not "cannot reach"."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from live_proxy import proxy_for
from pdserve import httpclient
from pdserve.commands.verify import verify
from pdserve.config import ProxyConfig
from pdserve.errors import Stalled, Unreachable
from pdserve.patience import Waiting
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import load_profile

_NUM_CLIENTS = 12
_TOKEN_DELAY_S = 0.03  # each decode token: 24-token answers take about 0.7 s, two at a time
_PATIENT = Waiting(stall_s=10.0, limit_s=300.0, poll_s=0.2, say_every_s=1.0)


@dataclass(frozen=True)
class SlowPair:
    url: str
    prefill: str
    decode: str
    model: str


@pytest.fixture
def slow_pair() -> Iterator[SlowPair]:
    # Decode runs two sequences at a time: the others wait in its queue, as behind a saturated engine.
    profile = dataclasses.replace(load_profile("tiny-cpu"), prompt_tokens_details=True, max_num_seqs=2)
    with sim_in_thread([SimInstanceSpec("prefill"), SimInstanceSpec("decode")], profile) as cluster:
        prefill, decode = cluster.urls
        config = ProxyConfig((prefill,), (decode,), port=0, kv_lease_s=profile.kv_lease_s)
        with proxy_for(config) as url:
            response = httpclient.post_json(f"{decode}/sim/faults", {"token_delay_s": _TOKEN_DELAY_S}, 10)
            assert response.status == 200
            yield SlowPair(url, prefill, decode, profile.served_model_name)


def _traffic(pair: SlowPair, stop: threading.Event, answered: list[int]) -> list[threading.Thread]:
    def client(n: int) -> None:
        body = {"model": pair.model, "max_tokens": 24, "ignore_eos": True}
        while not stop.is_set():
            prompt = f"other client {n} request {answered[0]} " + "words " * 60
            try:
                response = httpclient.post_json(f"{pair.url}/v1/completions", {**body, "prompt": prompt}, 120)
            except Unreachable:
                continue
            answered[0] += response.status == 200

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(_NUM_CLIENTS)]
    for t in threads:
        t.start()
    return threads


def test_verify_beside_heavy_traffic_waits_its_turn_passes_and_names_its_requests(
    slow_pair: SlowPair,
) -> None:
    stop, answered, said = threading.Event(), [0], []
    threads = _traffic(slow_pair, stop, answered)
    try:
        report = verify(slow_pair.url, say=said.append, waiting=_PATIENT)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert report.ok, "\n".join([*report.lines(), *said])
    assert answered[0] > _NUM_CLIENTS
    queued = [line for line in said if "queued behind" in line]
    assert queued and f"at decode {slow_pair.decode} (running 2, waiting" in " ".join(queued), said
    # Its requests by id: announced, listed at the end, and each one found in the proxy's /requests.
    pd_ids = [rid for rid in report.request_ids if rid.count("-") == 2]
    assert len(pd_ids) == 4 and all(f"sending {rid}" in " ".join(said) for rid in pd_ids)
    assert said[-1] == "requests sent: " + ", ".join(report.request_ids)
    for rid in pd_ids:
        listing = httpclient.get(f"{slow_pair.url}/requests?id={rid}", 10).json()
        assert [r["request_id"] for r in listing["requests"]] == [rid]


def test_verify_on_a_decode_that_stopped_stepping_fails_with_a_stall_naming_it(slow_pair: SlowPair) -> None:
    response = httpclient.post_json(f"{slow_pair.decode}/sim/stall", {"seconds": 20}, 10)
    assert response.status == 200
    with pytest.raises(Stalled) as caught:
        verify(slow_pair.url, say=lambda _line: None, waiting=dataclasses.replace(_PATIENT, stall_s=3.0))
    said = str(caught.value)
    assert "stalled: nothing moved for" in said and f"decode {slow_pair.decode}" in said
    assert said.startswith("verify-") and "cannot reach" not in said
