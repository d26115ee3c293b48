"""Who holds a killed prefill's GPU memory when prefill and decode share one GPU, and what frees it.

On one H200 (2026-12-03) a SIGKILLed prefill could not be restarted next to its decode: vLLM's
start-up found only 13 of 140 GiB free, the dead prefill's share still allocated after its whole process
group was gone. The suspect is decode: NIXL READs over cuda_ipc make UCX map prefill's KV buffers into
decode's process, UCX keeps the mappings in its IPC cache (UCX_CUDA_IPC_CACHE, on by default), and the
driver frees exported memory only when every importer has unmapped it.

Each phase is a 1P1D pair as `pdserve up --device cuda` plans it (both on GPU 0 at 0.45, decode started
once prefill is healthy), under extra environment for both instances:

  cache-on   what `up` planned until now: a PD request (KV pulled), prefill SIGKILLed, GPU memory sampled;
             then decode SIGKILLed, memory sampled again. If decode holds prefill's memory, the first kill
             frees nothing (or only what the exporter had not shared) and the second frees both shares.
  cache-off  UCX_CUDA_IPC_CACHE=n on both: the same request and prefill kill, memory sampled; then prefill
             is started again next to the running decode and a PD request must pull from the new one.

    python3 benchmarks/gpu_restart.py --out DIR [--phases cache-on,cache-off]

Prints lines and writes DIR/gpu_restart.json; the instances' logs stay in DIR/<phase>/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import print_result, script_parser
from pdserve.commands.verify import ask
from pdserve.engines.supervisor import restart_hint
from pdserve.engines.transfers import transfer_counts
from pdserve.stack import Stack, wait_http_ok
from pdserve.topology import Topology

PHASES: dict[str, dict[str, str]] = {
    "cache-on": {},
    "cache-off": {"UCX_CUDA_IPC_CACHE": "n"},
}
SAMPLE_S = 15.0


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def gpu_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, timeout=20, check=True,
    ).stdout  # fmt: skip
    return int(out.split()[0])


def sample(seconds: float) -> list[int]:
    """GPU 0's used memory every second for ``seconds``."""
    found = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found.append(gpu_used_mib())
        time.sleep(1.0)
    return found


def pd_request(stack: Stack, tag: str) -> dict[str, Any]:
    """One greedy completion through the proxy; whether it was a 200 and moved KV over NIXL once."""
    decodes = stack.urls("decode")
    before = transfer_counts(decodes)
    body = {"prompt": f"{tag}: " + "the harbour lights came on one by one " * 40, "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    answer = ask(stack.proxy_url, "/v1/completions", body, timeout=60)
    time.sleep(1.0)
    moved = transfer_counts(decodes) - before
    return {"status": answer.status, "text": answer.text[:60], "error": (answer.error or "")[:300],
            "transfers": moved.successful, "failed": moved.failed, "bytes": moved.bytes}  # fmt: skip


def run_phase(name: str, extra_env: dict[str, str], out: Path, port: int) -> dict[str, Any]:
    os.environ.update(extra_env)  # the launcher passes its environment on to both instances
    topology = Topology(
        model="tiny",
        device="cuda", vllm_args=("--enforce-eager",), on_instance_exit="stop", run_dir=str(out / name),
        engine_python=sys.executable, proxy_port=port, first_port=port + 100, first_side_channel_port=port - 2400,
    )  # fmt: skip
    record: dict[str, Any] = {"env": extra_env}
    stack = Stack(topology, say=say)
    try:
        record["idle_mib"] = gpu_used_mib()
        stack.start()
        prefill, decode = (next(s for s in stack.specs if s.role == r) for r in ("prefill", "decode"))
        record["pair_mib"] = gpu_used_mib()
        record["first_request"] = pd_request(stack, f"{name} first")
        say(f"{name}: pair up, {record['pair_mib']} MiB used; request {record['first_request']}")
        stack.group.kill(prefill)
        record["after_prefill_kill_mib"] = sample(SAMPLE_S)
        say(f"{name}: prefill SIGKILLed; GPU MiB each second: {record['after_prefill_kill_mib']}")
        if name == "cache-on":
            stack.group.kill(decode)
            record["after_decode_kill_mib"] = sample(SAMPLE_S)
            say(f"{name}: decode SIGKILLed too; GPU MiB each second: {record['after_decode_kill_mib']}")
            return record
        deadline = time.monotonic() + 30
        while not stack.group.can_respawn(prefill) and time.monotonic() < deadline:
            time.sleep(0.5)
        started = time.monotonic()
        stack.group.respawn(prefill)
        deadline = started + 240
        while time.monotonic() < deadline and not stack.group.is_healthy(prefill):
            if prefill in stack.group.exited():
                break
            time.sleep(1.0)
        healthy = stack.group.is_healthy(prefill)
        record["restart"] = {"healthy": healthy, "seconds": round(time.monotonic() - started, 1)}
        if not healthy:
            tail = stack.group.log_tail(prefill, 60)
            record["restart"]["hint"] = restart_hint(tail)
            record["restart"]["tail"] = tail[-3000:]
            say(f"{name}: prefill did NOT come back: {record['restart']['hint'] or tail[-800:]}")
            return record
        say(f"{name}: prefill healthy again {record['restart']['seconds']} s after its restart")
        wait_http_ok(f"{stack.proxy_url}/health", 30)
        for attempt in range(30):  # the proxy's health check takes prefill back within a few seconds
            answer = pd_request(stack, f"{name} after restart {attempt}")
            if answer["status"] == 200:
                break
            time.sleep(1.0)
        record["after_restart_request"] = answer
        say(f"{name}: request after the restart: {answer}")
        return record
    except Exception as exc:  # record what happened; the other phase still runs
        record["error"] = f"{type(exc).__name__}: {exc}"
        say(f"{name} FAILED: {record['error']}")
        return record
    finally:
        stack.stop()
        for key in extra_env:
            os.environ.pop(key, None)
        record["after_stop_mib"] = gpu_used_mib()


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--port", type=int, default=8300)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"phases": {}}
    for name in a.phases.split(","):
        report["phases"][name] = run_phase(name, PHASES[name], a.out, a.port)
        (a.out / "gpu_restart.json").write_text(json.dumps(report, indent=1))
    print_result(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
