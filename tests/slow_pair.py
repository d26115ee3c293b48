"""A slow simulated 1P1D pair behind a real proxy, and clients that keep it saturated: decode runs two
sequences at a time and every token costs it more, so other requests wait in its queue, as behind a
saturated engine (for the tools that must keep working under load)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from live_proxy import proxy_for
from pdserve import httpclient
from pdserve.config import ProxyConfig
from pdserve.errors import Unreachable
from pdserve.prometheus import NUM_RUNNING, scrape
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import load_profile

NUM_CLIENTS = 12
_TOKEN_DELAY_S = 0.03  # each decode token: 24-token answers take about 0.7 s, two at a time


@dataclass(frozen=True)
class SlowPair:
    url: str
    prefill: str
    decode: str
    model: str

    def stall_decode(self, seconds: float) -> None:
        response = httpclient.post_json(f"{self.decode}/sim/stall", {"seconds": seconds}, 10)
        assert response.status == 200


@contextmanager
def slow_pair() -> Iterator[SlowPair]:
    profile = dataclasses.replace(load_profile("tiny-cpu"), prompt_tokens_details=True, max_num_seqs=2)
    with sim_in_thread([SimInstanceSpec("prefill"), SimInstanceSpec("decode")], profile) as cluster:
        prefill, decode = cluster.urls
        config = ProxyConfig.pd((prefill,), (decode,), port=0, kv_lease_s=profile.kv_lease_s)
        with proxy_for(config) as url:
            response = httpclient.post_json(f"{decode}/sim/faults", {"token_delay_s": _TOKEN_DELAY_S}, 10)
            assert response.status == 200
            yield SlowPair(url, prefill, decode, profile.served_model_name)


@contextmanager
def heavy_traffic(pair: SlowPair) -> Iterator[list[int]]:
    """NUM_CLIENTS clients sending one request after another through the proxy; [requests answered 200]."""
    stop, answered = threading.Event(), [0]

    def client(n: int) -> None:
        body = {"model": pair.model, "max_tokens": 24, "ignore_eos": True}
        while not stop.is_set():
            prompt = f"other client {n} request {answered[0]} " + "words " * 60
            try:
                response = httpclient.post_json(f"{pair.url}/v1/completions", {**body, "prompt": prompt}, 120)
            except Unreachable:
                continue
            answered[0] += response.status == 200

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    try:
        # Saturated before the body runs: with the clients just started, decode may not yet run two.
        deadline = time.monotonic() + 30
        while scrape(pair.decode).get(NUM_RUNNING, 0.0) < 2:
            assert time.monotonic() < deadline, "the clients never saturated decode"
            time.sleep(0.05)
        yield answered
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
