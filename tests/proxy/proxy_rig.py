"""Servers for the proxy tests: fakes and the real proxy, each in its own thread (as separate processes
would be), on sockets bound before they start so callers may connect at once."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fake_vllm import FakeVLLM

from asgi_rig import listening_socket, serve_in_thread
from pdserve.config import ProxyConfig, Timeouts
from pdserve.configparts import HealthChecks, PoolSpec, Retries
from pdserve.proxy.serving.server import make_server

# Short, so fault tests end quickly; every wait in a test is bounded by one of these plus slack.
TIMEOUTS = Timeouts(connect=1, prefill=2, first_token=2, idle=1, decode=3)
CLIENT_TIMEOUT = 15.0  # a broken proxy fails the test instead of hanging it


@dataclass(frozen=True)
class Rig:
    url: str  # the proxy's base URL
    prefill: FakeVLLM
    decode: FakeVLLM
    prefill_url: str
    decode_url: str


@contextmanager
def serve_fake(fake: FakeVLLM) -> Iterator[str]:
    config = uvicorn.Config(
        fake.app, log_config=None, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    with serve_in_thread(uvicorn.Server(config), listening_socket()) as url:
        yield url


# Each role's failures reach the client: no decode computing a failed prefill's prompt, no prefill standing
# in for a failed decode. For the tests of those error paths.
STRICT = Retries(fallback_to_local_prefill=False, prefill_stands_in=False)

# Breakers would carry one fault test's failures into the next on a shared rig: off unless asked.
NO_BREAKER = HealthChecks(breaker_threshold=10**6)


def elastic_pool(urls: Sequence[str], **spec: Any) -> tuple[PoolSpec, ...]:
    """The pools of a proxy in front of an elastic pool of ``urls`` (``running_proxy(pools=...)``)."""
    return (PoolSpec("elastic", tuple(urls), **spec),)


@contextmanager
def running_proxy(
    prefill_urls: Sequence[str] = (), decode_urls: Sequence[str] = (), **config: Any
) -> Iterator[str]:
    """A real proxy server (``make_server``: uvloop, httptools) on a free port; yields its URL. Its pools:
    ``prefill_urls`` and ``decode_urls``, or ``pools=`` given instead."""
    sock = listening_socket()
    pools = (PoolSpec("prefill", tuple(prefill_urls)), PoolSpec("decode", tuple(decode_urls)))
    config = {"health": NO_BREAKER, "pools": pools, **config}
    proxy_config = ProxyConfig(port=sock.getsockname()[1], timeouts=TIMEOUTS, **config)
    with serve_in_thread(make_server(proxy_config, log_level="warning"), sock) as url:
        yield url


class DiesAfterItsFirstCheck:
    """An instance that passes the proxy's first health check (the proxy checks at once when it starts),
    then is gone: its port refuses connections. A member that died between two checks, as the requests
    that meet it first find it (the port refuses them from ``died()`` on)."""

    def __init__(self) -> None:
        self._sock = listening_socket()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._answered = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed: died
            with conn:
                request = conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            if request.startswith(b"GET /health"):
                self._answered.set()

    def died(self, timeout_s: float = CLIENT_TIMEOUT) -> str:
        """Once a health check passed: close the port, and the URL that now refuses connections."""
        assert self._answered.wait(timeout_s), "the proxy never checked it"
        # A close alone would leave the thread in accept() holding the socket open: the port would go on
        # answering. A shutdown wakes it and stops the listening.
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout_s)
        return self.url
