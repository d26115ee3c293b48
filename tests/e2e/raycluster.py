"""A real two-node Ray cluster on one machine: the head and a worker, each in its own network namespace
(tests/e2e/netns.py), each `ray start --block` in its own process group.

Stopped by process group, worker first, never by `ray stop` (that kills every Ray process on the
machine by name, other people's included). Each node has its own temp dir: both share one filesystem,
and Ray's default (/tmp/ray) would have them share sockets and session files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from netns import Host, Resource

RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 26379  # inside the head's namespace; pdserve's tests keep Ray in 26000-26999
_WORKER_PORTS = ("--min-worker-port=26400", "--max-worker-port=26499")
_STARTED = "Ray runtime started"
_NODE_ATTEMPTS = 3


def _rss_kib(sid: int) -> int:
    """Resident memory of every process of session ``sid`` (`ray start` leads its own; Ray's workers
    stay in it, an instance's process starts a session of its own)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == sid:
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE") // 1024  # rss is field 24 of stat
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class Node:
    host: Host
    resources: dict[str, float]
    temp_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def stop(self, timeout: float = 5.0) -> float:
        """SIGTERM the node's process group, SIGKILL it after ``timeout`` (a head drains up to 30 s); seconds."""
        started = time.monotonic()
        if self.proc is None:
            return 0.0
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):  # what `ray start` left of its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        return time.monotonic() - started

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class RayCluster(Resource):
    head: Node
    worker: Node
    env: dict[str, str]
    start_s: float = 0.0
    stop_s: dict[str, float] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.head.host.address}:{GCS_PORT}"

    def open(self, timeout: float = 180.0) -> RayCluster:
        started = time.monotonic()
        head_args = ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        for node, args in ((self.head, head_args), (self.worker, [f"--address={self.address}"])):
            for attempt in range(_NODE_ATTEMPTS):
                self._start_node(node, args)
                try:
                    self._wait_started(node, started + timeout)
                    break
                except RuntimeError:
                    # `ray start` gives a raylet a fixed 30 s to register (ray/_private/node.py); on a
                    # loaded 2-core machine that can pass: a fresh try usually makes it.
                    node.stop()
                    shutil.rmtree(node.temp_dir, ignore_errors=True)
                    if attempt == _NODE_ATTEMPTS - 1:
                        raise
        self.start_s = time.monotonic() - started
        return self

    def rss_mib(self) -> float:
        """Resident memory of both nodes' Ray processes, their actors' workers included."""
        return sum(_rss_kib(n.proc.pid) for n in (self.head, self.worker) if n.proc) / 1024

    def close(self) -> None:
        for name, node in (("worker", self.worker), ("head", self.head)):
            self.stop_s[name] = node.stop()
            shutil.rmtree(node.temp_dir, ignore_errors=True)

    def _start_node(self, node: Node, role_args: list[str]) -> None:
        node.temp_dir.mkdir(parents=True, exist_ok=True)
        command = [
            *node.host.exec_prefix,
            RAY,
            "start",
            "--block",
            *role_args,
            f"--node-ip-address={node.host.address}",
            "--num-cpus=1",
            "--object-store-memory=100000000",  # pdserve moves no objects; Ray's default is 30% of RAM
            "--disable-usage-stats",
            f"--temp-dir={node.temp_dir}",
            f"--resources={json.dumps(node.resources)}",
            *_WORKER_PORTS,
        ]
        with open(node.log_path, "wb") as log:
            node.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def _wait_started(self, node: Node, deadline: float) -> None:
        while _STARTED not in node.log_path.read_text(errors="replace"):
            if not node.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed:\n{node.log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
