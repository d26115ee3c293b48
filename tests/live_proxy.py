"""A real pdserve proxy in front of simulated instances, for the tools that read a proxy over HTTP only
(`pdserve top`, the dashboard's metric names): everything on free ports, in threads, as separate
processes would be."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve import httpclient
from pdserve.config import ProxyConfig
from pdserve.proxy.serving.server import make_server
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import load_profile

_START_S = 30.0  # generous: other suites may load the two cores meanwhile


@dataclass(frozen=True)
class LiveProxy:
    url: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    model: str

    def complete(self, prompt: str, max_tokens: int = 4) -> None:
        """One completion through the proxy, split into prefill and decode; it must succeed."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        response = httpclient.post_json(f"{self.url}/v1/completions", body, timeout=10)
        assert response.status == 200, response.body[:300]


@contextmanager
def live_proxy(
    num_prefill: int = 2, num_decode: int = 2, prompt_tokens_details: bool = False
) -> Iterator[LiveProxy]:
    # tiny-cpu: measured step times and KV sizes, so transfers take time and move bytes (zero costs none).
    profile = load_profile("tiny-cpu")
    profile = dataclasses.replace(profile, prompt_tokens_details=prompt_tokens_details)
    specs = [SimInstanceSpec("prefill")] * num_prefill + [SimInstanceSpec("decode")] * num_decode
    with sim_in_thread(specs, profile) as cluster:
        urls = tuple(cluster.urls)
        config = ProxyConfig.pd(urls[:num_prefill], urls[num_prefill:], port=0, kv_lease_s=profile.kv_lease_s)
        with proxy_for(config) as url:
            yield LiveProxy(url, urls[:num_prefill], urls[num_prefill:], profile.served_model_name)


@contextmanager
def proxy_for(config: ProxyConfig) -> Iterator[str]:
    """A real proxy of ``config`` on a free port (``config.port`` is replaced), healthy; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = make_server(dataclasses.replace(config, port=port), log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _START_S
        while not httpclient.is_ok(f"{url}/health"):
            assert time.monotonic() < deadline, f"the proxy at {url} did not become healthy"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
