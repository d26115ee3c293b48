"""What the proxy costs: pdserve vs vllm-router (Rust) in front of the same zero-cost P/D pair.

Both proxies front one fake prefill and one fake decode instance that cost (almost) nothing: a raw
asyncio server speaking vLLM's PD wire format (prefill answers ``kv_transfer_params``, decode streams one
SSE event per token, each written on its own loop turn, as vLLM does). The load comes from a lean
closed-loop client on raw keep-alive connections (``httptools``), so the generator's own cost stays small
next to the proxies' (pdserve's own generator, bench/load.py, parses every event on aiohttp: its cost per
request would rival the proxies', and move their figures with it). Every cell (whole or streamed, tokens, concurrency) runs for each proxy in turn,
round after round (interleaved), and medians over rounds are reported, with the ratio to the router.
The c=1,024 cells are the proxy's headroom under overload: whatever pdserve does to hold requests back
(admission, the decode's back-pressure) must leave it at least the router's requests/s there, with 0 errors.

Reported per cell: requests/s, end-to-end latency p50/p99 (with zero-cost engines, that is the proxy's
added latency plus queueing in the closed loop), and the proxy's CPU seconds per 1,000 requests (its
processes' user+system time). Then, per proxy: RSS per open stream with ``--open-streams`` streams held
open at once (each has its first token; decode then waits), over the RSS with none open.

    .venv/bin/python benchmarks/proxy_overhead.py [--router /tmp/router-venv/bin/vllm-router]
        [--rounds 3] [--seconds 4] [--modes stream,whole] [--tokens 16,256] [--concurrency 64,256,1024]
        [--open-streams 1000] [--baseline-src /tmp/pdserve-base/src] [--first-port 23100]

vllm-router is not a pdserve dependency: `python -m venv /tmp/router-venv && /tmp/router-venv/bin/pip
install vllm-router`; without it only pdserve runs. ``--baseline-src`` runs another pdserve's src/ beside
this one (e.g. `git archive HEAD src | tar -x -C /tmp/pdserve-base`), for before/after comparisons.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httptools
import orjson
import uvloop

from pdserve.bench.load import percentile

HOST = "127.0.0.1"
_HOLD_TOKENS = 1_000_000  # a decode asked for this many tokens sends one and holds the stream open
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")

# --- the zero-cost fake instance ----------------------------------------------------------------------

_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
       "remote_engine_id": "fake-engine", "remote_request_id": "cmpl-fake-0", "remote_host": HOST,
       "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 60,
       "remote_blocks_expiry_time": None, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0}  # fmt: skip
_HEAD = b'data: {"id":"cmpl-fake","object":"text_completion","created":1,"model":"fake-model","choices":[{"index":0,"text":'
_MID = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
_TOKEN = _HEAD + b'" tok"' + _MID
_TOKEN_CHUNK = b"%x\r\n" % len(_TOKEN) + _TOKEN + b"\r\n"
# Asked for ``return_token_ids`` (a proxy that may continue a stream elsewhere asks), vLLM puts each
# event's ids in its choice and the prompt's (60 tokens here) in the first.
_IDS_MID = (
    b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":%s,"token_ids":[%d]}]}\n\n'
)
_PROMPT_IDS = b"[" + b",".join(b"%d" % (1000 + i) for i in range(60)) + b"]"


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n" % len(event) + event + b"\r\n"


_FIRST_IDS_CHUNK = _chunk(_HEAD + b'" tok"' + _IDS_MID % (_PROMPT_IDS, 1234))
_IDS_CHUNK = _chunk(_HEAD + b'" tok"' + _IDS_MID % (b"null", 1234))
_DONE_CHUNK = b"%x\r\n" % len(b"data: [DONE]\n\n") + b"data: [DONE]\n\n\r\n0\r\n\r\n"
_MODELS = orjson.dumps(
    {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": 4096}]}
)


def _whole(body: bytes, content_type: bytes = b"application/json", status: bytes = b"200 OK") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip


def _answer(num_tokens: int, kv: object) -> bytes:
    return orjson.dumps({"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake-model",
                         "choices": [{"index": 0, "text": " tok" * num_tokens, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}],
                         "usage": {"prompt_tokens": 60, "total_tokens": 60 + num_tokens,
                                   "completion_tokens": num_tokens},
                         "kv_transfer_params": kv})  # fmt: skip


_PREFILL = _whole(_answer(1, _KV))
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)


class _FakeInstance(asyncio.Protocol):
    """One connection to the fake: requests one after another (keep-alive), answers pre-encoded."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._task: asyncio.Task[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._wholes: dict[int, bytes] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._task is not None:
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url, raw = self._url, b"".join(self._body)
        self._url, self._body = b"", []
        transport = self._transport
        assert transport is not None
        if url == b"/health":
            transport.write(_whole(b"{}"))
        elif url == b"/v1/models":
            transport.write(_whole(_MODELS))
        elif url == b"/metrics":
            transport.write(_whole(b"", b"text/plain"))
        else:
            body = orjson.loads(raw)
            kv = body.get("kv_transfer_params") or {}
            num_tokens = int(body.get("max_tokens") or 16)
            if kv.get("do_remote_decode"):
                transport.write(_PREFILL)
            elif body.get("stream"):
                ids = body.get("return_token_ids") is True
                self._task = asyncio.get_running_loop().create_task(self._stream(transport, num_tokens, ids))
            else:
                if num_tokens not in self._wholes:
                    self._wholes[num_tokens] = _whole(_answer(num_tokens, None))
                transport.write(self._wholes[num_tokens])

    async def _stream(self, transport: asyncio.Transport, num_tokens: int, ids: bool) -> None:
        transport.write(_STREAM_HEAD + (_FIRST_IDS_CHUNK if ids else _TOKEN_CHUNK))
        if num_tokens >= _HOLD_TOKENS:
            await asyncio.Event().wait()  # until the connection goes
        chunk = _IDS_CHUNK if ids else _TOKEN_CHUNK
        for _ in range(num_tokens - 1):
            await asyncio.sleep(0)  # one event per loop turn: the proxy sees them one by one
            transport.write(chunk)
        transport.write(_DONE_CHUNK)


def serve_fakes(ports: list[int]) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port in ports:
            await loop.create_server(_FakeInstance, HOST, port, backlog=4096, reuse_port=True)
        await asyncio.Event().wait()

    uvloop.run(main())


# --- the load client ------------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One keep-alive connection of the closed loop: one request at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._done: asyncio.Future[tuple[int, float, bytes]] | None = None
        self._first = 0.0
        self._tail = b""
        self.first_seen: asyncio.Event | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError("connection closed"))
            self._done.exception()  # retrieved: a held stream closed on purpose is no error
        self.transport = None

    def request(self, raw: bytes) -> asyncio.Future[tuple[int, float, bytes]]:
        if self.transport is None:
            raise ConnectionError("connection closed")
        self._done = asyncio.get_running_loop().create_future()
        self._first, self._tail = 0.0, b""
        self.transport.write(raw)
        return self._done

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._done is not None and not self._done.done():
                self._done.set_exception(exc)

    def on_body(self, body: bytes) -> None:
        if not self._first:
            self._first = time.perf_counter()
            if self.first_seen is not None:
                self.first_seen.set()
        self._tail = (self._tail + body)[-64:]

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result((self._parser.get_status_code(), self._first, self._tail))


def _request(port: int, i: int, stream: bool, tokens: int) -> bytes:
    body = orjson.dumps({"model": "fake-model", "prompt": f"request {i}: " + "lorem ipsum " * 20,
                         "max_tokens": tokens, "temperature": 0, "stream": stream})  # fmt: skip
    return (b"POST /v1/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (HOST.encode(), port, len(body))) + body  # fmt: skip


@dataclass(frozen=True)
class Cell:
    mode: str  # "stream" or "whole"
    tokens: int
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.mode} {self.tokens} tok c={self.concurrency}"


@dataclass(frozen=True)
class Result:
    req_per_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    cpu_s_per_1k: float
    num_failed: int


async def _connect(port: int) -> _Client:
    _, client = await asyncio.get_running_loop().create_connection(_Client, HOST, port)
    return client


async def _closed_loop(port: int, cell: Cell, seconds: float) -> tuple[list[float], list[float], int, float]:
    stream = cell.mode == "stream"
    clients = await asyncio.gather(*(_connect(port) for _ in range(cell.concurrency)))
    latencies: list[float] = []
    ttfts: list[float] = []
    failed = 0
    counter = 0
    begun = time.perf_counter()
    deadline = begun + seconds

    async def worker(client: _Client) -> None:
        nonlocal failed, counter
        while time.perf_counter() < deadline:
            counter += 1
            sent = time.perf_counter()
            try:
                if client.transport is None:
                    client = await _connect(port)
                status, first, tail = await client.request(_request(port, counter, stream, cell.tokens))
            except (ConnectionError, OSError, httptools.HttpParserError):
                failed += 1
                continue
            ended = time.perf_counter()
            if status != 200 or (stream and not tail.endswith(b"data: [DONE]\n\n")):
                failed += 1
                continue
            latencies.append(ended - sent)
            ttfts.append(first - sent)

    await asyncio.gather(*(worker(c) for c in clients))
    elapsed = time.perf_counter() - begun
    for client in clients:
        if client.transport is not None:
            client.transport.close()
    return latencies, ttfts, failed, elapsed


def _pct(values: list[float], q: float) -> float:
    """In ms."""
    return percentile(values, q) * 1000


def _run_closed_loop(port: int, cell: Cell, seconds: float) -> tuple[list[float], list[float], int, float]:
    return uvloop.run(_closed_loop(port, cell, seconds))


def _load(port: int, cell: Cell, seconds: float, clients: ProcessPoolExecutor | None, num_clients: int
          ) -> tuple[list[float], list[float], int, float]:  # fmt: skip
    if clients is None:
        return _run_closed_loop(port, cell, seconds)
    share = Cell(cell.mode, cell.tokens, cell.concurrency // num_clients)
    parts = list(
        clients.map(_run_closed_loop, [port] * num_clients, [share] * num_clients, [seconds] * num_clients)
    )
    return ([x for p in parts for x in p[0]], [x for p in parts for x in p[1]], sum(p[2] for p in parts),
            max(p[3] for p in parts))  # fmt: skip


def measure(port: int, sid: int | None, cell: Cell, seconds: float, clients: ProcessPoolExecutor | None = None,
            num_clients: int = 1) -> Result:  # fmt: skip
    _load(port, cell, min(1.0, seconds / 4), clients, num_clients)  # warm-up: connections, caches
    cpu_before = _cpu_s(sid)
    latencies, ttfts, failed, elapsed = _load(port, cell, seconds, clients, num_clients)
    cpu = _cpu_s(sid) - cpu_before
    n = len(latencies)
    return Result(n / elapsed, _pct(latencies, 0.5), _pct(latencies, 0.99), _pct(ttfts, 0.5),
                  cpu / n * 1000 if n else float("nan"), failed)  # fmt: skip


async def _open_streams(port: int, n: int, sample: Any) -> int:
    """Open ``n`` held streams; once each has its first token, ``sample()`` (RSS); then close them."""
    clients: list[_Client] = []
    for start in range(0, n, 100):  # in batches: a burst of 1,000 SYNs overflows small backlogs
        clients += await asyncio.gather(*(_connect(port) for _ in range(start, min(n, start + 100))))
    for i, client in enumerate(clients):
        client.first_seen = asyncio.Event()
        client.request(_request(port, i, True, _HOLD_TOKENS))
    async with asyncio.timeout(60):
        await asyncio.gather(*(c.first_seen.wait() for c in clients if c.first_seen is not None))
    await asyncio.sleep(0.5)
    value: int = sample()
    for client in clients:
        if client.transport is not None:
            client.transport.close()
    await asyncio.sleep(1.0)
    return value


# --- processes and their accounting ---------------------------------------------------------------------


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[3]) == sid:  # field 6 of stat: the session id
                    pids.append(int(entry))
    return pids


def _cpu_s(sid: int | None) -> float:
    if sid is None:
        return float("nan")
    total = 0
    for pid in _session_pids(sid):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLK_TCK


def _rss_bytes(sid: int) -> int:
    total = 0
    for pid in _session_pids(sid):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    return total


def _wait_ok(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ConnectionError, TimeoutError, httptools.HttpParserError):
            if uvloop.run(_health(port)) == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"port {port} not healthy within {timeout} s")


async def _health(port: int) -> int:
    client = await _connect(port)
    try:
        async with asyncio.timeout(2):
            status, _, _ = await client.request(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    finally:
        if client.transport is not None:
            client.transport.close()
    return status


@contextmanager
def process(
    cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None, is_first: bool = True
) -> Iterator[int]:
    """Start ``cmd`` in its own session; yields its pid (= session id) once ``port`` answers /health."""
    if is_first:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            raise RuntimeError(f"port {port} is taken: another run? (--first-port)")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})  # fmt: skip
    try:
        _wait_ok(port)
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _pdserve(prefill: int, decode: int, port: int, workers: int = 1) -> list[str]:
    # Defaults but for the pool size, which must hold --open-streams decode connections at once. A
    # --baseline-src from before the proxy's rooms serves from proxy/workers.py, one from before --workers
    # from proxy/serving/server.py; one from before the pools by role takes the URLs as prefill_urls and
    # decode_urls.
    many = f", workers={workers}" if workers > 1 else ""
    urls = f"('http://{HOST}:{prefill}',), ('http://{HOST}:{decode}',)"
    code = ("from pdserve.config import ProxyConfig\n"
            "try:\n    from pdserve.proxy.serving.workers import serve\n"
            "except ImportError:\n    try:\n        from pdserve.proxy.workers import serve\n"
            "    except ImportError:\n        from pdserve.proxy.serving.server import serve\n"
            "make = getattr(ProxyConfig, 'pd', None) or "
            "(lambda p, d, **kw: ProxyConfig(prefill_urls=p, decode_urls=d, **kw))\n"
            f"serve(make({urls}, host='{HOST}', port={port}, max_connections_per_upstream=4096{many}), 'warning')")  # fmt: skip
    return [sys.executable, "-c", code]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--seconds", type=float, default=4.0, help="per cell, per proxy, per round")
    parser.add_argument("--modes", default="stream,whole")
    parser.add_argument("--tokens", default="16,256")
    parser.add_argument("--concurrency", default="64,256,1024")
    parser.add_argument("--open-streams", type=int, default=1000, help="0: skip the memory measurement")
    parser.add_argument("--router", default=shutil.which("vllm-router"), help="vllm-router binary")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct-to-decode floor")
    parser.add_argument("--baseline-src", metavar="DIR", help="another pdserve's src/, run beside this one")
    parser.add_argument("--first-port", type=int, default=23100)
    parser.add_argument("--workers", default="1", help="pdserve's worker processes, one path per value: 1,2")
    parser.add_argument("--clients", type=int, default=1, help="load-generating processes")
    parser.add_argument("--fake-procs", type=int, default=1, help="fake-instance processes (SO_REUSEPORT)")
    parser.add_argument("--proxy-cpus", help="taskset CPU list for the proxies, e.g. 0-1 (the same for each)")
    parser.add_argument("--fake-cpus", help="taskset CPU list for the fake instances")
    parser.add_argument("--logs", default="/tmp/pdserve-bench")
    parser.add_argument("--serve-fakes", metavar="PORT", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fakes:
        serve_fakes(args.serve_fakes)
        return 0
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    p = args.first_port
    prefill, decode = p, p + 1
    proxies: dict[str, tuple[list[str], int, dict[str, str]]] = {}
    for i, workers in enumerate(int(w) for w in args.workers.split(",")):
        name, port = ("pdserve" if workers == 1 else f"pdserve {workers} workers"), p + 6 + i if i else p + 2
        proxies[name] = (_pdserve(prefill, decode, port, workers), port, {})
    if args.baseline_src:
        env = {"PYTHONPATH": str(Path(args.baseline_src).resolve())}
        proxies["pdserve baseline"] = (_pdserve(prefill, decode, p + 5), p + 5, env)
    if args.router:
        router = [args.router, "--vllm-pd-disaggregation", "--prefill", f"http://{HOST}:{prefill}",
                  "--decode", f"http://{HOST}:{decode}", "--host", HOST, "--port", str(p + 3),
                  "--policy", "round_robin", "--prometheus-port", str(p + 4)]  # fmt: skip
        proxies["vllm-router"] = (router, p + 3, {})
    cells = [Cell(m, int(t), int(c)) for m in args.modes.split(",") for t in args.tokens.split(",")
             for c in args.concurrency.split(",")]  # fmt: skip
    fake = [sys.executable, __file__, "--serve-fakes", str(prefill), str(decode)]
    if args.fake_cpus:
        fake = ["taskset", "-c", args.fake_cpus, *fake]
    if args.proxy_cpus:
        proxies = {name: (["taskset", "-c", args.proxy_cpus, *cmd], port, env)
                   for name, (cmd, port, env) in proxies.items()}  # fmt: skip
    clients = ProcessPoolExecutor(args.clients) if args.clients > 1 else None
    samples: dict[tuple[str, str], list[Result]] = {}
    rss: dict[str, tuple[int, int]] = {}
    with contextlib.ExitStack() as running:
        for i in range(args.fake_procs):
            running.enter_context(process(fake, decode, logs / f"fakes-{i}.log", is_first=i == 0))
        sids: dict[str, int | None] = {} if args.no_direct else {"direct to decode (floor)": None}
        ports = {"direct to decode (floor)": decode}
        for name, (cmd, port, env) in proxies.items():
            sids[name] = running.enter_context(
                process(cmd, port, logs / f"{name.replace(' ', '-')}.log", env)
            )
            ports[name] = port
        for r in range(args.rounds):
            for cell in cells:
                for name, sid in sids.items():
                    result = measure(ports[name], sid, cell, args.seconds, clients, args.clients)
                    samples.setdefault((cell.name, name), []).append(result)
                    print(f"round {r + 1} {cell.name:22} {name:26} {result}", file=sys.stderr, flush=True)
        if args.open_streams:
            for name in proxies:
                sid = sids[name]
                assert sid is not None
                idle = _rss_bytes(sid)
                held = uvloop.run(_open_streams(ports[name], args.open_streams, lambda s=sid: _rss_bytes(s)))
                rss[name] = (idle, held)
    if clients is not None:
        clients.shutdown()
    report(args, cells, list(sids), samples, rss)
    return 0


def _median(runs: list[Result]) -> Result:
    def mid(values: list[float]) -> float:
        return statistics.median(values)

    return Result(mid([r.req_per_s for r in runs]), mid([r.p50_ms for r in runs]), mid([r.p99_ms for r in runs]),
                  mid([r.ttft_p50_ms for r in runs]), mid([r.cpu_s_per_1k for r in runs]),
                  sum(r.num_failed for r in runs))  # fmt: skip


def report(args: argparse.Namespace, cells: list[Cell], names: list[str],
           samples: dict[tuple[str, str], list[Result]], rss: dict[str, tuple[int, int]]) -> None:  # fmt: skip
    print(f"\n{args.rounds} interleaved round(s) x {args.seconds:g} s per cell, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; medians over rounds; ratios: pdserve / vllm-router, median of the rounds' ratios")  # fmt: skip
    print(
        "| cell | path | req/s | p50 ms | p99 ms | TTFT p50 ms | CPU s / 1k req | failed | req/s ratio | p50 ratio | p99 ratio |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows: dict[str, Any] = {}
    for cell in cells:
        router = (
            _median(samples[(cell.name, "vllm-router")]) if (cell.name, "vllm-router") in samples else None
        )
        for name in names:
            m = _median(samples[(cell.name, name)])
            rows[f"{cell.name} | {name}"] = m.__dict__
            ratios: tuple[str, ...] = ("", "", "")
            if router is not None and name.startswith("pdserve"):
                # Each round's ratio, then their median: the load drifts between rounds on a shared
                # machine, less within one round, where the two ran back to back.
                pairs = list(
                    zip(samples[(cell.name, name)], samples[(cell.name, "vllm-router")], strict=True)
                )
                ratios = tuple(f"{statistics.median(getattr(a, f) / getattr(b, f) for a, b in pairs):.2f}x"
                               for f in ("req_per_s", "p50_ms", "p99_ms"))  # fmt: skip
                rows[f"{cell.name} | {name}"]["ratios"] = ratios
            print(f"| {cell.name} | {name} | {m.req_per_s:.0f} | {m.p50_ms:.1f} | {m.p99_ms:.1f} | "
                  f"{m.ttft_p50_ms:.1f} | {m.cpu_s_per_1k:.3f} | {m.num_failed} | {' | '.join(ratios)} |")  # fmt: skip
    if rss:
        print(f"\n| proxy | RSS idle | RSS with {args.open_streams} open streams | per open stream |")
        print("| --- | ---: | ---: | ---: |")
        for name, (idle, held) in rss.items():
            per = (held - idle) / args.open_streams / 1024
            rows[f"rss | {name}"] = {"idle": idle, "held": held, "per_stream_kib": per}
            print(f"| {name} | {idle / 2**20:.1f} MiB | {held / 2**20:.1f} MiB | {per:.1f} KiB |")
    (Path(args.logs) / "proxy_overhead.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())
