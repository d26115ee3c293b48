"""What one request costs the proxy's own code, with no sockets: the whole app (``ProxyApp``, the
generation endpoint, the flow) over in-memory prefill and decode instances that answer at once.

proxy_overhead.py measures the proxy as it runs (HTTP, the kernel, uvicorn), which on a small shared
machine moves ±10 % from run to run. This measures only the Python the proxy runs per request, so a
change of a few percent shows: CPU µs per request (``time.process_time``), and with ``--callgrind`` the
instructions per request that valgrind counts, the same from run to run to a tenth of a percent (two
run lengths, subtracted, so start-up cancels). Each src/ runs in its own process, the current one and
each ``--baseline-src`` in turn, round after round.

    .venv/bin/python benchmarks/request_cost.py [--baseline-src /tmp/pdserve-base/src] [--modes whole,stream]
        [--requests 5000] [--rounds 3] [--callgrind] [--no-migrate-streams] [--no-decode-wait]

``--no-migrate-streams`` adds a row: the current src/ served as ``pdserve proxy --no-migrate-streams``
serves (decode not asked for token ids, nothing cut from its events), to tell that feature's cost from
the rest's; ``--no-decode-wait`` one served as ``--max-decode-wait 0`` serves (no back-pressure from decode:
no place kept at decode per request), to tell the back-pressure's cost from the rest's.

The instances answer as vLLM's PD pair does (prefill's ``kv_transfer_params``, decode 16 tokens whole or
as 16 SSE events); garbage collection is tuned as the proxy's process tunes it (server.tune_gc).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from _common import instructions_per_unit

_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3, 4],
       "remote_engine_id": "fake-engine", "remote_request_id": "cmpl-fake-0", "remote_host": "127.0.0.1",
       "remote_port": 5600, "tp_size": 1, "remote_prefill_cached_tokens": 0}  # fmt: skip
_TOKEN = (b'data: {"id":"cmpl-fake","object":"text_completion","created":1,"model":"fake-model","choices":'
          b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n')  # fmt: skip
# With ``return_token_ids`` (a stream that may migrate asks for them) vLLM writes each event's ids.
_TOKEN_IDS = _TOKEN.replace(
    b'"stop_reason":null}', b'"stop_reason":null,"prompt_token_ids":null,"token_ids":[1234]}'
)
_NUM_TOKENS = 16


def _answer(num_tokens: int, kv: object) -> bytes:
    import orjson

    return orjson.dumps({"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake-model",
                         "choices": [{"index": 0, "text": " tok" * num_tokens, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}],
                         "usage": {"prompt_tokens": 60, "total_tokens": 60 + num_tokens,
                                   "completion_tokens": num_tokens},
                         "kv_transfer_params": kv})  # fmt: skip


class _Stream:
    status = 200
    content_type = "text/event-stream; charset=utf-8"

    def __init__(self, token: bytes) -> None:
        self._token = token

    async def read_all(self, timeout: float) -> bytes:
        return b""

    async def chunks(self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
                     ) -> AsyncIterator[bytes]:  # fmt: skip
        for _ in range(_NUM_TOKENS):
            yield self._token
        yield b"data: [DONE]\n\n"


class _Instance:
    """An instance that answers at once: prefill its params, decode its tokens (the proxy's Upstream)."""

    def __init__(self, role: str, url: str) -> None:
        try:
            from pdserve.proxy.wire.upstream import Reply
        except ImportError:  # a --baseline-src from before the proxy's rooms
            from pdserve.proxy.upstream import Reply  # type: ignore[no-redef,import-not-found,unused-ignore]

        self.role, self.url = role, url
        self._prefill = Reply(200, "application/json", _answer(1, _KV))
        self._whole = Reply(200, "application/json", _answer(_NUM_TOKENS, None))
        self._other = Reply(200, "application/json", b"{}")

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get(self, path: str, phase: str, timeout: float) -> Any:
        return self._other

    async def post(self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float,
                   is_repeatable: bool = False) -> Any:  # fmt: skip
        return self._prefill if b'"do_remote_decode":true' in body else self._whole

    @contextlib.asynccontextmanager
    async def open_stream(self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
                          ) -> AsyncIterator[_Stream]:  # fmt: skip
        yield _Stream(_TOKEN_IDS if b'"return_token_ids":true' in body else _TOKEN)


async def _serve(
    mode: str, num_requests: int, num_warm: int, rounds: int, migrate: bool = True, decode_wait: bool = True
) -> list[float]:
    """CPU µs per request of each round, after ``num_warm`` requests to warm up."""
    from pdserve.config import ProxyConfig

    try:
        from pdserve.proxy.serving.app import ProxyApp, create_app
    except ImportError:  # a --baseline-src from before the proxy's rooms
        from pdserve.proxy.app import ProxyApp, create_app  # type: ignore[no-redef,import-not-found,unused-ignore]

    options: dict[str, Any] = {}
    if not migrate:
        from pdserve.configparts import Retries

        options["retries"] = Retries(migrate_streams=False)
    if not decode_wait:
        from pdserve.configparts import AdmissionLimits

        options["admission"] = AdmissionLimits(max_decode_wait_s=0)
    options.update(host="127.0.0.1", port=1, max_connections_per_upstream=4096)
    try:
        config = ProxyConfig.pd(("http://p:1",), ("http://d:1",), **options)
    except AttributeError:  # a --baseline-src from before the pools by role
        config = ProxyConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",), **options)  # type: ignore[call-arg,unused-ignore]
    starlette_app = create_app(config, _Instance)  # type: ignore[arg-type]
    ctx = starlette_app.state.pdserve
    ctx.flow.max_model_len = 4096  # as the proxy learns it from decode's /v1/models
    app = ProxyApp(starlette_app)
    await ctx.state.open()
    never = asyncio.get_running_loop().create_future()  # the client stays connected
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (b"host", b"127.0.0.1:1"), (b"content-type", b"application/json")]}  # fmt: skip

    async def send(message: Any) -> None:
        return None

    async def one(i: int) -> None:
        import orjson

        body = orjson.dumps({"model": "fake-model", "prompt": f"request {i}: " + "lorem ipsum " * 20,
                             "max_tokens": _NUM_TOKENS, "temperature": 0, "stream": mode == "stream"})  # fmt: skip
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> Any:
            return messages.pop() if messages else await never

        await app(scope, receive, send)

    for i in range(num_warm):
        await one(i)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    costs = []
    for _ in range(rounds):
        begun = time.process_time()
        for i in range(num_requests):
            await one(i)
        costs.append((time.process_time() - begun) / num_requests * 1e6)
    return costs


def _child(args: argparse.Namespace) -> int:
    costs = asyncio.run(_serve(args.mode, args.requests, args.warm, args.rounds, not args.no_migrate_streams,
                               not args.no_decode_wait))  # fmt: skip
    print(" ".join(f"{c:.2f}" for c in costs))
    return 0


def _run(src: str, mode: str, requests: int, warm: int, rounds: int, callgrind_out: str | None = None,
         extra: tuple[str, ...] = ()) -> str:  # fmt: skip
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--requests", str(requests), "--warm", str(warm),
           "--rounds", str(rounds), *extra]  # fmt: skip
    if callgrind_out is not None:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind_out}", *cmd]
    env = {**os.environ, "PYTHONPATH": src}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout


def _instructions(src: str, mode: str, extra: tuple[str, ...] = ()) -> float:
    """Instructions per request: two run lengths under callgrind, subtracted."""
    return instructions_per_unit(lambda n, out: _run(src, mode, n, 300, 1, out, extra))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline-src", action="append", default=[], help="another pdserve's src/ (repeatable)"
    )
    parser.add_argument("--modes", default="whole,stream")
    parser.add_argument("--requests", type=int, default=5000, help="per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each src, interleaved")
    parser.add_argument("--warm", type=int, default=2000, help="requests before the measured ones")
    parser.add_argument("--callgrind", action="store_true", help="also count instructions (valgrind)")
    parser.add_argument(
        "--no-migrate-streams", action="store_true", help="also the current src/ without migration"
    )
    parser.add_argument(
        "--no-decode-wait", action="store_true", help="also the current src/ without the back-pressure"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="whole", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    here = str(Path(__file__).resolve().parent.parent / "src")
    srcs = {"this": os.environ.get("PYTHONPATH") or here, **{f"baseline {i + 1}": s for i, s in
                                                             enumerate(args.baseline_src)}}  # fmt: skip
    extras: dict[str, tuple[str, ...]] = dict.fromkeys(srcs, ())
    if args.no_migrate_streams:
        srcs["this, --no-migrate-streams"] = srcs["this"]
        extras["this, --no-migrate-streams"] = ("--no-migrate-streams",)
    if args.no_decode_wait:
        srcs["this, --max-decode-wait 0"] = srcs["this"]
        extras["this, --max-decode-wait 0"] = ("--no-decode-wait",)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; "
        + ", ".join(f"{k}: {v}" for k, v in srcs.items())
    )
    print("| mode | src | CPU µs / request (median of rounds) | instructions / request |")
    print("| --- | --- | ---: | ---: |")
    for mode in args.modes.split(","):
        costs: dict[str, list[float]] = {name: [] for name in srcs}
        for _ in range(args.rounds):  # one round of each src in turn, so drifting load hits all alike
            for name, src in srcs.items():
                out = _run(src, mode, args.requests, args.warm, 1, extra=extras[name])
                costs[name] += [float(c) for c in out.split()]
        for name, src in srcs.items():
            count = f"{_instructions(src, mode, extras[name]):,.0f}" if args.callgrind else "-"
            print(f"| {mode} | {name} | {statistics.median(costs[name]):.1f} | {count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
