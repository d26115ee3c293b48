"""A stand-in for `python -m vllm.entrypoints.openai.api_server`, for launcher tests.

Takes the vLLM flags the launcher passes (--host, --port) plus its own:
  --delay S          seconds before /health answers (vLLM loads the model meanwhile)
  --crash-after S    print an error and exit with code 3 after S seconds instead of serving
  --ignore-sigterm   keep running on SIGTERM (a wedged engine)
  --child            fork a child that sleeps, like vLLM's engine-core process, and log a line of it as
                     vLLM does ("(EngineCore pid=N) ..."), with no process title (as without setproctitle)
  --crash-if-exists PATH   as --crash-after 0.1 when PATH exists at start (a restart that keeps failing)
  --slow-if-exists PATH    as --delay 60 when PATH exists at start (a restart that takes long)
  --write-pid PATH         write its pid to PATH at start (a decode that maps a prefill's GPU memory)
  --gpu-held-by PATH       exit with vLLM's "Free memory on device" error while the process whose pid PATH
                           holds runs (a prefill whose dead predecessor's memory a live decode keeps mapped)
  --traceback-lines N      after that error, N lines of traceback (vLLM's API server prints ~60)
  --metrics-file PATH      answer /metrics with what PATH holds when asked (vLLM's counters, as a test sets them)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Health(BaseHTTPRequestHandler):
    metrics_file: str | None = None

    def do_GET(self) -> None:
        body = b""
        if self.path == "/metrics" and self.metrics_file is not None:
            body = Path(self.metrics_file).read_bytes()
        self.send_response(200 if self.path == "/health" or body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _is_running(pid_file: str) -> bool:
    try:
        stat = Path(f"/proc/{int(Path(pid_file).read_text())}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # a killed process not yet reaped holds nothing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--crash-after", type=float, default=None)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--crash-if-exists")
    parser.add_argument("--slow-if-exists")
    parser.add_argument("--write-pid")
    parser.add_argument("--gpu-held-by")
    parser.add_argument("--traceback-lines", type=int, default=0)
    parser.add_argument("--metrics-file")
    args, _unknown = parser.parse_known_args()
    if args.write_pid:
        with open(args.write_pid, "w") as f:
            f.write(str(os.getpid()))
    if args.gpu_held_by and _is_running(args.gpu_held_by):
        # vLLM 0.26's words (v1/worker/utils.py), as a prefill restarted beside a live decode printed them
        print("(EngineCore pid=1) ValueError: Free memory on device cuda:0 (13.19/139.8 GiB) on startup is "
              "less than desired GPU memory utilization (0.45, 62.91 GiB).", flush=True)  # fmt: skip
        for i in range(args.traceback_lines):
            print(
                f'(APIServer pid=2)   File "vllm/v1/engine/core_client.py", line {i}, in __init__', flush=True
            )
        sys.exit(1)
    if args.crash_if_exists and os.path.exists(args.crash_if_exists):
        args.crash_after = 0.1
    if args.slow_if_exists and os.path.exists(args.slow_if_exists):
        args.delay = 60.0

    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"(EngineCore pid={child.pid}) INFO fake engine core started", flush=True)
    print(f"fake engine loading model for port {args.port}", flush=True)
    if args.crash_after is not None:
        time.sleep(args.crash_after)
        print("Traceback (most recent call last):", flush=True)
        print("RuntimeError: fake engine failed to allocate KV cache", flush=True)
        sys.exit(3)
    time.sleep(args.delay)
    Health.metrics_file = args.metrics_file
    server = ThreadingHTTPServer((args.host, args.port), Health)
    print(f"fake engine serving on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
