"""A proxy of several worker processes on one port (workers.py, worker.py, peers.py): the kernel spreads
clients over them; what a client reads of the proxy, or changes through its admin API, spans them all;
what the launcher learns reaches each; a worker that dies comes back while the others serve."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from fake_vllm import FakeVLLM
from proxy_rig import CLIENT_TIMEOUT, TIMEOUTS, serve_fake
from starlette.requests import Request
from starlette.responses import Response
from test_flow import COMPLETION
from test_tokens import SYSTEM, _write_model_dir

from pdserve.config import ProxyConfig
from pdserve.configparts import ApiKeys, HealthChecks, PoolSpec, Routing
from pdserve.errors import ProxyStartError
from pdserve.events import InstanceEvent
from pdserve.prometheus import parse_prometheus, parse_samples
from pdserve.proxy.serving.peers import (
    PARTIAL_HEADER,
    Peers,
    merge_descriptions,
    partial_headers,
    socket_path,
)
from pdserve.proxy.serving.workers import ProxyWorkers

KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def workers_proxy(prefill: Sequence[str], decode: Sequence[str], **config: Any) -> Iterator[ProxyWorkers]:
    settings = {
        "health": HealthChecks(breaker_threshold=10**6),
        "api_keys": ApiKeys(admin=KEY),
        "workers": 2,
        **config,
    }
    pools = (PoolSpec("prefill", tuple(prefill)), PoolSpec("decode", tuple(decode)))
    settings = {"pools": pools, **settings}
    proxy = ProxyWorkers(ProxyConfig(port=_free_port(), timeouts=TIMEOUTS, **settings))
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def fakes() -> Iterator[tuple[FakeVLLM, FakeVLLM, list[str]]]:
    prefill, decode = FakeVLLM("prefill"), FakeVLLM("decode")
    with serve_fake(prefill) as p0, serve_fake(decode) as d0:
        yield prefill, decode, [p0, d0]


@pytest.fixture
async def fresh() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that opens a new connection for every request, as many clients would."""
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


async def _complete(http: aiohttp.ClientSession, url: str, prompt: str = "hello") -> None:
    async with http.post(f"{url}/v1/completions", json={**COMPLETION, "prompt": prompt}) as resp:
        assert resp.status == 200, await resp.text()


async def _own(path: str, route: str, headers: dict[str, str] | None = None) -> Any:
    """One worker's own answer, over its Unix socket."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http,
        http.get(f"http://worker{route}", headers=headers) as resp,
    ):
        assert resp.status == 200
        return await resp.read()


def _served(metrics: bytes) -> float:
    return parse_prometheus(metrics.decode()).get("pdserve_requests_total", 0.0)


async def test_clients_are_spread_over_the_workers_and_every_read_counts_them_all(
    fakes: tuple[FakeVLLM, FakeVLLM, list[str]], fresh: aiohttp.ClientSession
) -> None:
    _, _, (p0, d0) = fakes
    with workers_proxy([p0], [d0]) as proxy:
        await asyncio.gather(*(_complete(fresh, proxy.url) for _ in range(40)))
        own = [_served(await _own(path, "/metrics")) for path in proxy.sockets]
        assert sum(own) == 40 and min(own) > 0, own  # both served; neither's view is the whole
        async with fresh.get(f"{proxy.url}/metrics") as resp:
            merged = parse_samples((await resp.read()).decode())
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in merged}
        assert values[("pdserve_requests_total", (("endpoint", "completions"), ("outcome", "ok")))] == 40
        assert values[("pdserve_kv_handoffs_total", (("state", "delivered"),))] == 40
        assert values[("pdserve_e2e_seconds_count", ())] == 40
        # A state both workers see stays 1, not 2: every worker's view must agree to show it.
        assert values[("pdserve_instance_available", (("role", "decode"), ("url", d0)))] == 1
        async with fresh.get(f"{proxy.url}/admin/ledger", headers=ADMIN) as resp:
            ledger = orjson.loads(await resp.read())
        assert (ledger["issued"], ledger["delivered"], len(ledger["recent"])) == (40, 40, 40)
        async with fresh.get(f"{proxy.url}/requests", headers=ADMIN) as resp:
            assert len(orjson.loads(await resp.read())["requests"]) == 40


async def test_an_admin_change_made_through_either_worker_is_made_by_both(
    fakes: tuple[FakeVLLM, FakeVLLM, list[str]], fresh: aiohttp.ClientSession
) -> None:
    _, decode, (p0, d0) = fakes
    other = FakeVLLM("decode")
    with serve_fake(other) as d1, workers_proxy([p0], [d0, d1]) as proxy:
        async with fresh.post(f"{proxy.url}/admin/instances/drain", json={"url": d0}, headers=ADMIN) as resp:
            assert resp.status == 200
        before = len(decode.generations())
        await asyncio.gather(*(_complete(fresh, proxy.url) for _ in range(20)))
        assert len(decode.generations()) == before  # no worker sends the drained decode anything
        assert len(other.generations()) == 20
        for path in proxy.sockets:
            states = {i["url"]: i["state"] for i in orjson.loads(await _own(path, "/instances"))}
            assert states[d0] == "draining"


def test_an_instance_reads_drained_only_when_no_worker_has_a_request_or_kv_waiting_there() -> None:
    # Each worker holds its own requests' handoffs: one worker's quiet view must not call it drained.
    own = [{"url": "http://p:1", "draining": True, "in_flight": 0, "kv_held": 0, "drained": True}]
    other = {"url": "http://p:1", "draining": True, "in_flight": 0, "kv_held": 2, "drained": False}
    [merged] = merge_descriptions(own, [[other]])
    assert (merged["in_flight"], merged["kv_held"], merged["drained"]) == (0, 2, False)
    [quiet] = merge_descriptions(own, [[{**other, "kv_held": 0}]])
    assert quiet["drained"] is True
    # Without every worker's view, a worker that did not answer may still have requests there.
    [unsure] = merge_descriptions(own, [[{**other, "kv_held": 0}]], is_whole=False)
    assert unsure["drained"] is False


async def test_what_the_launcher_learns_reaches_every_worker(
    fakes: tuple[FakeVLLM, FakeVLLM, list[str]],
) -> None:
    _, _, (p0, d0) = fakes
    with workers_proxy([p0], [d0]) as proxy:
        proxy.deliver(InstanceEvent(d0, "exited", "status -9"))
        for path in proxy.sockets:
            states = {i["url"]: i["state"] for i in orjson.loads(await _own(path, "/instances"))}
            assert states[d0] == "restarting"
        proxy.deliver(InstanceEvent(d0, "ready"))
        for path in proxy.sockets:  # each worker meets the prefill (its warm-up canary), then serves
            for _ in range(50):
                states = {i["url"]: i["state"] for i in orjson.loads(await _own(path, "/instances"))}
                if states[d0] != "warming":
                    break
                await asyncio.sleep(0.1)
            assert states[d0] == "serving"


async def test_a_push_that_never_came_to_a_decode_is_counted_by_every_worker(
    fakes: tuple[FakeVLLM, FakeVLLM, list[str]],
) -> None:
    _, _, (p0, d0) = fakes
    health = HealthChecks(breaker_threshold=10**6, rest_after_stranded_pushes=2)
    with workers_proxy([p0], [d0], health=health) as proxy:
        # a third worker's word, as the worker that saw the pushes fail would send it
        count = len(proxy.sockets)
        teller = Peers(os.path.dirname(proxy.sockets[0]), index=count, count=count + 1)
        for _ in range(2):
            teller.tell_stranded(d0)
        for path in proxy.sockets:
            for _ in range(50):
                [seen] = [i for i in orjson.loads(await _own(path, "/instances")) if i["url"] == d0]
                if seen["stranded_pushes"] == 2:
                    break
                await asyncio.sleep(0.1)
            # the only decode: resting, and still serving what comes
            assert (seen["state"], seen["stranded_pushes"]) == ("resting", 2)
            await _own_completion(path, "still served")
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.url}/metrics") as resp:
            merged = parse_samples((await resp.read()).decode())
        # each worker counted both: the proxy's count is 2, not one sum of the workers' counts
        [stranded] = [
            s.value for s in merged if s.name == "pdserve_instance_stranded_pushes" and s.labels["url"] == d0
        ]
        assert stranded == 2


async def test_prefix_aware_workers_send_a_shared_prefix_where_either_sent_it(tmp_path: Path) -> None:
    model_dir = _write_model_dir(tmp_path)
    prefills, decode = [FakeVLLM("prefill"), FakeVLLM("prefill")], FakeVLLM("decode")
    with (
        serve_fake(prefills[0]) as p0, serve_fake(prefills[1]) as p1, serve_fake(decode) as d0,
        workers_proxy([], [], pools=(PoolSpec("prefill", (p0, p1), policy="prefix_aware"), PoolSpec("decode", (d0,))),
                      routing=Routing(tokenizer=str(model_dir), prefix_block_size=4)) as proxy,
    ):  # fmt: skip
        first, second = proxy.sockets
        # Worker 0 sends an unrelated prompt first, so that its next tie goes to the second prefill.
        await _own_completion(first, "something else entirely")
        await _own_completion(first, SYSTEM + "what is prefill?")
        assert [len(p.generations()) for p in prefills] == [1, 1]
        await asyncio.sleep(0.5)  # worker 1 hears of it within a gossip interval (0.1 s)
        for i in range(3):  # worker 1 would break its own tie toward the first prefill
            await _own_completion(second, SYSTEM + f"question {i}: why split them?")
    assert [len(p.generations()) for p in prefills] == [1, 4]


async def _own_completion(path: str, prompt: str) -> None:
    """A completion sent to one worker, over its Unix socket (it serves every route there too)."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http,
        http.post("http://worker/v1/completions", json={**COMPLETION, "prompt": prompt}) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_a_worker_that_dies_is_started_again_while_the_other_serves(
    fakes: tuple[FakeVLLM, FakeVLLM, list[str]], fresh: aiohttp.ClientSession
) -> None:
    _, _, (p0, d0) = fakes
    with workers_proxy([p0], [d0]) as proxy:
        first = proxy.pids[0]
        assert first is not None
        os.kill(first, signal.SIGKILL)
        while not _has_exited(first):  # its listening socket leaves the port only once it has exited
            await asyncio.sleep(0.05)
        await asyncio.gather(*(_complete(fresh, proxy.url) for _ in range(10)))  # the other one serves
        deadline = time.monotonic() + 30
        while proxy.pids[0] in (first, None) or not await _answers(proxy.sockets[0]):
            assert time.monotonic() < deadline, "the dead worker was not started again"
            await asyncio.sleep(0.2)


async def _answers(path: str) -> bool:
    try:
        await _own(path, "/_pdserve/ready")
    except (aiohttp.ClientError, AssertionError):
        return False
    return True


def test_a_port_taken_by_another_program_fails_the_start_and_leaves_nothing_running(
    fakes: tuple[FakeVLLM, FakeVLLM, list[str]],
) -> None:
    _, _, (p0, d0) = fakes
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proxy = ProxyWorkers(ProxyConfig.pd((p0,), (d0,), port=port, workers=2))
        with pytest.raises(ProxyStartError, match=f"port {port}"):
            proxy.start()
    assert all(pid is None or not _alive(pid) for pid in proxy.pids)


def _has_exited(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet: either way its sockets are closed."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_peer_request_with_a_line_break_in_a_header_value_is_refused_unsent(tmp_path: Path) -> None:
    received: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(record, socket_path(str(tmp_path), 1))
    try:
        peers = Peers(str(tmp_path), 0, 2)
        with pytest.raises(ValueError, match="line break"):
            await peers.ask("GET", "/metrics", None, {"Authorization": "Bearer k\r\nX-Evil: 1"})
        assert (await peers.ask("GET", "/metrics", None, ADMIN)).answers == {1: (200, b"ok")}
    finally:
        server.close()
    assert len(received) == 1 and b"Bearer admin-key" in received[0]  # only the well-formed one went


# --- a worker that does not answer its peers ---------------------------------------------------------

PEER_METRICS = (
    b"# HELP pdserve_requests_total R.\n# TYPE pdserve_requests_total counter\npdserve_requests_total 3\n"
)


def _answer(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)


@contextmanager
def _peer_sockets(tmp_path: Path) -> Iterator[Callable[[int, bytes | None], Awaitable[None]]]:
    """Peers on Unix sockets in ``tmp_path``: ``await serve(i, raw)`` makes worker ``i`` answer every
    request with ``raw`` (None: take the request and never answer)."""
    servers: list[asyncio.Server] = []

    async def serve(index: int, raw: bytes | None) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            if raw is None:
                await asyncio.sleep(30)
            writer.write(raw or b"")
            await writer.drain()
            writer.close()

        servers.append(await asyncio.start_unix_server(handle, socket_path(str(tmp_path), index)))

    try:
        yield serve
    finally:
        for server in servers:
            server.close()


def _client_request(path: str, method: str = "GET", body: bytes = b"") -> Request:
    """A request as it reaches a worker over the shared TCP port (so the worker asks its peers)."""

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "headers": [],
             "server": ("127.0.0.1", 8000)}  # fmt: skip
    return Request(scope, receive)


async def test_a_merged_read_names_a_worker_that_does_not_answer_and_counts_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _peer_sockets(tmp_path) as serve:
        await serve(1, _answer(200, PEER_METRICS))
        await serve(2, None)  # takes the request, never answers
        peers = Peers(str(tmp_path), 0, 4, timeout_s=0.3)  # and nothing listens for worker 3
        request = _client_request("/metrics")
        text = await peers.metrics(request, PEER_METRICS.decode())
    said = partial_headers(request)[PARTIAL_HEADER]
    assert said.startswith("worker 2: no answer within 0.3 s; worker 3: cannot connect"), said
    values = {(s.name, tuple(s.labels.items())): s.value for s in parse_samples(text)}
    assert values[("pdserve_requests_total", ())] == 6  # this worker's and worker 1's
    assert values[("pdserve_workers_missing", ())] == 2
    misses = {labels: v for (name, labels), v in values.items() if name == "pdserve_worker_misses_total"}
    assert misses == {(("worker", "1"),): 0, (("worker", "2"),): 1, (("worker", "3"),): 1}
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("no answer from worker 2 for GET /metrics" in m for m in logged), logged


async def test_a_worker_answering_an_error_is_left_out_of_a_merged_read_and_named(tmp_path: Path) -> None:
    with _peer_sockets(tmp_path) as serve:
        await serve(1, _answer(500, b"{}"))
        peers = Peers(str(tmp_path), 0, 2)
        request = _client_request("/admin/ledger")
        own = {"lease_s": 5, "issued": 1, "delivered": 1, "abandoned": {}, "suspect": {}, "open": [],
               "overdue": 0, "recent": []}  # fmt: skip
        assert await peers.ledger(request, own) == own
    assert partial_headers(request) == {PARTIAL_HEADER: "worker 1: answered 500"}


async def test_an_answer_every_worker_gave_carries_no_partial_mark(tmp_path: Path) -> None:
    with _peer_sockets(tmp_path) as serve:
        await serve(1, _answer(200, b"[]"))
        peers = Peers(str(tmp_path), 0, 2)
        request = _client_request("/instances")
        assert await peers.instances(request, []) == []
    assert partial_headers(request) == {}


async def test_an_admin_change_a_worker_did_not_make_is_named_in_the_answer(tmp_path: Path) -> None:
    with _peer_sockets(tmp_path) as serve:
        await serve(1, _answer(200, b"{}"))
        await serve(2, _answer(409, b"{}"))
        peers = Peers(str(tmp_path), 0, 4, timeout_s=0.3)  # nothing listens for worker 3
        response = Response(b"{}", 200)
        await peers.repeat(_client_request("/admin/instances/drain", "POST", b"{}"), response)
    said = response.headers[PARTIAL_HEADER]
    assert said.startswith("worker 3: cannot connect") and said.endswith("; worker 2: answered 409"), said
