"""Client connections are held to deadlines and a cap (proxy/serving/server.py): a connection that sends nothing,
trickles its headers or its body, or idles after an answer is closed; one past the cap is refused with a
503 it can read. Thousands of idle sockets are all closed."""

from __future__ import annotations

import resource
import selectors
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
from proxy_rig import Rig, running_proxy

from pdserve.configparts import AdmissionLimits

FAST = AdmissionLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5)


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=5)


def read_until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, float]:
    """What the proxy sends before it closes ``sock``, and how long it took to close it."""
    start = time.monotonic()
    sock.settimeout(within_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


@contextmanager
def proxy(rig: Rig, limits: AdmissionLimits = FAST) -> Iterator[str]:
    with running_proxy([rig.prefill_url], [rig.decode_url], admission=limits) as url:
        yield url


def test_a_connection_that_sends_nothing_is_closed_quietly(rig: Rig) -> None:
    with proxy(rig) as url, connect(url) as sock:
        data, took = read_until_closed(sock, 5)
    assert data == b""
    assert 0.3 < took < 3


def test_headers_trickled_a_byte_at_a_time_get_a_408_and_the_connection_closed(rig: Rig) -> None:
    with proxy(rig) as url, connect(url) as sock:
        start = time.monotonic()
        sent = b""
        # a byte every 0.1 s: each byte is news, none completes the headers
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            sent += bytes([byte])
            time.sleep(0.1)
            if time.monotonic() - start > 3:
                break
        data, _ = read_until_closed(sock, 5)
    assert time.monotonic() - start < 4
    assert data.startswith(b"HTTP/1.1 408"), data


def test_a_body_that_never_completes_gets_a_408_and_the_connection_closed(rig: Rig) -> None:
    with proxy(rig) as url, connect(url) as sock:
        sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model"')
        data, took = read_until_closed(sock, 5)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert took < 3


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(rig: Rig) -> None:
    with proxy(rig) as url, connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = read_until_closed(sock, 5)
    assert data.startswith(b"HTTP/1.1 200"), data
    assert took < 3


def test_the_connection_past_the_cap_gets_a_503_it_can_read(rig: Rig) -> None:
    limits = AdmissionLimits(max_connections=20)
    with proxy(rig, limits) as url:
        held = [connect(url) for _ in range(20)]
        try:
            time.sleep(0.2)  # the proxy has accepted them
            with connect(url) as extra:
                data, _ = read_until_closed(extra, 5)
            assert data.startswith(b"HTTP/1.1 503"), data
            assert b"retry-after: 1" in data.lower()
            assert b"20 client connections open, its limit" in data
            # the held ones still serve
            held[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_until_closed(held[0], 5)[0].startswith(b"HTTP/1.1 200")
        finally:
            for sock in held:
                sock.close()


@pytest.fixture
def many_fds() -> Iterator[int]:
    """Room for 2 fds per idle socket (the client's end and the proxy's, one process here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 16384)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield (wanted - 200) // 2
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_thousands_of_idle_connections_are_all_closed(rig: Rig, many_fds: int) -> None:
    num = min(3000, many_fds)
    assert num >= 1000, f"the fd limit leaves room for {num} sockets only"
    limits = AdmissionLimits(header_timeout_s=1.0, max_connections=num + 10)
    with proxy(rig, limits) as url:
        socks: list[socket.socket] = []
        try:
            for i in range(num):
                socks.append(connect(url))
                if i % 2 == 1:
                    socks[-1].sendall(b"GET /heal")  # half of them begin a request, then stop
            selector = selectors.DefaultSelector()
            for sock in socks:
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            open_ = set(socks)
            deadline = time.monotonic() + 30
            while open_ and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        if sock.recv(65536):
                            continue  # the 408, then the close
                    except ConnectionError:
                        pass
                    selector.unregister(sock)
                    open_.discard(sock)
            assert not open_, f"{len(open_)} of {num} idle connections still open after 30 s"
        finally:
            for sock in socks:
                sock.close()
