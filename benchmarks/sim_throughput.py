"""Streamed tokens per second from one zero-cost sim decode instance.

Starts ``python -m pdserve.sim --prefill 0 --decode 1 --first-port 0`` in a subprocess (so the server has
its own interpreter and core), then streams completions from this process with aiohttp, ``--concurrency``
at a time, for ``--duration`` seconds. Tokens are counted from each stream's final usage chunk
(``stream_options.include_usage``), so the count is the server's, not a parse of every chunk.

    .venv/bin/python benchmarks/sim_throughput.py [--concurrency 64] [--max-tokens 256] [--duration 10]
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp

from _common import script_parser


@dataclass
class Totals:
    requests: int = 0
    tokens: int = 0
    errors: int = 0


def start_sim(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.sim",
        "--prefill",
        "0",
        "--decode",
        "1",
        "--first-port",
        "0",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("decode "):
        proc.kill()
        raise SystemExit(f"sim did not start: {line!r}")
    return proc, line.split()[1]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (Linux /proc), or None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def completion_tokens(tail: bytes) -> int:
    """``usage.completion_tokens`` of the last usage chunk in a stream's tail."""
    start = tail.rfind(b'data: {"id"')
    event = tail[start + len(b"data: ") :].split(b"\n\n", 1)[0]
    return int(json.loads(event)["usage"]["completion_tokens"])


async def client(
    session: aiohttp.ClientSession, url: str, body: bytes, deadline: float, totals: Totals
) -> None:
    headers = {"Content-Type": "application/json"}
    while time.perf_counter() < deadline:
        try:
            async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
                tail = b""
                async for chunk in resp.content.iter_any():
                    tail = (tail + chunk)[-4096:]
                totals.tokens += completion_tokens(tail)
                totals.requests += 1
        except (aiohttp.ClientError, ValueError, KeyError) as exc:
            totals.errors += 1
            print(f"request failed: {exc!r}", file=sys.stderr)


async def run(url: str, concurrency: int, max_tokens: int, duration: float) -> tuple[Totals, float]:
    body = json.dumps(
        {
            "prompt": "The quick brown fox jumps over the lazy dog " * 4,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    totals = Totals()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        warm = Totals()
        await client(session, url, body, time.perf_counter() + 1.0, warm)  # connections, caches
        start = time.perf_counter()
        deadline = start + duration
        await asyncio.gather(*(client(session, url, body, deadline, totals) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return totals, elapsed


def main() -> int:
    parser = script_parser(__doc__, {"--concurrency": 64, "--max-tokens": 256, "--duration": 10.0})
    args = parser.parse_args()
    proc, url = start_sim(["--log-level", "warning"])
    try:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        cpu_start, client_start = cpu_seconds(proc.pid), time.process_time()
        totals, elapsed = asyncio.run(run(url, args.concurrency, args.max_tokens, args.duration))
        cpu_end, client_cpu = cpu_seconds(proc.pid), time.process_time() - client_start
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(
        f"sim decode {url}: {totals.requests} streamed requests, {totals.tokens} tokens in {elapsed:.2f} s "
        f"(concurrency {args.concurrency}, max_tokens {args.max_tokens}, {totals.errors} errors)"
    )
    print(f"streamed tokens/s: {totals.tokens / elapsed:,.0f}   requests/s: {totals.requests / elapsed:,.1f}")
    if cpu_start is not None and cpu_end is not None and totals.tokens:
        # Includes the 1 s warm-up; a busy machine lowers tokens/s but not these.
        server_us = 1e6 * (cpu_end - cpu_start) / totals.tokens
        client_us = 1e6 * client_cpu / totals.tokens
        print(f"CPU per streamed token: server {server_us:.1f} us, client {client_us:.1f} us")
    return 1 if totals.errors else 0


if __name__ == "__main__":
    sys.exit(main())
