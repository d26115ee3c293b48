"""What one call costs the proxy's HTTP client (proxy/wire/), which request_cost.py leaves out (its
instances are in memory): ``HTTPUpstream`` against a raw server in the same process, over loopback TCP.

Two calls of a request: a whole POST as prefill's (a small JSON answer) and a stream as decode's (16 SSE
events, chunked). The server is this script's, the same for every src/, so a difference in instructions
is the client's. Instructions per call with valgrind's callgrind (two run lengths, subtracted, so that
start-up cancels), CPU µs per call without; each src/ in its own process, the current one and each
``--baseline-src``.

    .venv/bin/python benchmarks/wire_cost.py [--baseline-src /tmp/pdserve-base/src] [--modes whole,stream]
        [--calls 3000] [--callgrind]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

from _common import instructions_per_unit

_BODY = b'{"id":"cmpl-1","choices":[{"text":" tok"}],"kv_transfer_params":{"remote_block_ids":[1,2,3,4]}}'
_WHOLE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_BODY),
    _BODY,
)
_EVENT = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":" tok","finish_reason":null}]}\n\n'
_STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           + b"".join(b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT) for _ in range(16)) + b"0\r\n\r\n")  # fmt: skip


class _Server(asyncio.Protocol):
    """Answers each whole request at once: a stream to POST /s, a whole answer to anything else."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: Any = transport
        self._buffer = b""

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while b"\r\n\r\n" in self._buffer:
            head, _, rest = self._buffer.partition(b"\r\n\r\n")
            length = next((int(line[15:]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            if len(rest) < length:
                return
            self._buffer = rest[length:]
            self._transport.write(_STREAM if head.startswith(b"POST /s ") else _WHOLE)


async def _calls(mode: str, num_calls: int, num_warm: int) -> float:
    """CPU µs per call, after ``num_warm`` calls."""
    from pdserve.proxy.wire.upstream import HTTPUpstream

    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Server, "127.0.0.1", 0)
    upstream = HTTPUpstream("decode", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", 2.0, 4)
    await upstream.open()
    headers = {"X-Request-Id": "r"}

    async def one() -> None:
        if mode == "whole":
            await upstream.post("/v1/completions", b'{"prompt":"x"}', headers, "prefill", 5)
            return
        async with upstream.open_stream("/s", b'{"prompt":"x"}', headers, "decode", 5) as stream:
            async for _ in stream.chunks(5, 5):
                pass

    for _ in range(num_warm):
        await one()
    begun = time.process_time()
    for _ in range(num_calls):
        await one()
    cost = (time.process_time() - begun) / num_calls * 1e6
    await upstream.close()
    server.close()
    return cost


def _run(src: str, mode: str, calls: int, callgrind_out: str | None = None) -> float:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--calls", str(calls)]
    if callgrind_out is not None:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind_out}", *cmd]
    env = {**os.environ, "PYTHONPATH": src}
    return float(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)


def _instructions(src: str, mode: str) -> float:
    return instructions_per_unit(lambda n, out: _run(src, mode, n, out))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline-src", action="append", default=[], help="another pdserve's src/ (repeatable)"
    )
    parser.add_argument("--modes", default="whole,stream")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--callgrind", action="store_true", help="also count instructions (valgrind)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="whole", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(uvloop.run(_calls(args.mode, args.calls, 300)))  # the proxy's loop (server.py)
        return 0
    here = str(Path(__file__).resolve().parent.parent / "src")
    srcs = {"this": here, **{f"baseline {i + 1}": s for i, s in enumerate(args.baseline_src)}}
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; "
          + ", ".join(f"{k}: {v}" for k, v in srcs.items()))  # fmt: skip
    print("| mode | src | CPU µs / call | instructions / call |")
    print("| --- | --- | ---: | ---: |")
    for mode in args.modes.split(","):
        for name, src in srcs.items():
            count = f"{_instructions(src, mode):,.0f}" if args.callgrind else "-"
            print(f"| {mode} | {name} | {_run(src, mode, args.calls):.1f} | {count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
