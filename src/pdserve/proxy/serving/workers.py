"""A proxy of several processes: ``config.workers`` workers (worker.py) sharing one port, started,
watched and stopped from the process that runs `pdserve proxy` or `pdserve up`.

Why processes: one CPython process is one core's worth of proxy (BENCHMARKS.md, "Proxy overhead against
vllm-router", and its archive), and the kernel spreads client connections over workers that all listen on the port (SO_REUSEPORT). What
each worker keeps is its own: health checks and circuit breakers of every instance (each worker checks
for itself), its share of the admission limits (``ProxyConfig.worker_share``), its requests' KV handoffs
and traces. Reads and admin changes span them all (peers.py); what the launcher learns reaches every
worker (``deliver``). A worker that exits is started again after a second; one that exits more than
``_MAX_EXITS`` times in ``_EXIT_WINDOW_S`` stays down, and the others serve.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from multiprocessing.process import BaseProcess

import orjson

from pdserve import events, httpclient
from pdserve.config import ProxyConfig
from pdserve.errors import ProxyStartError, Unreachable
from pdserve.events import InstanceEvent, KVLogEvent
from pdserve.proxy.serving.peers import PEER_TIMEOUT_S, socket_path
from pdserve.proxy.serving.server import make_server, tune_gc
from pdserve.proxy.serving.worker import run_worker

log = logging.getLogger("pdserve.proxy")

_START_TIMEOUT_S = 30.0
_POLL_S = 0.2
_RESTART_DELAY_S = 1.0
_MAX_EXITS = 5
_EXIT_WINDOW_S = 60.0


class ProxyWorkers:
    def __init__(self, config: ProxyConfig, log_level: str = "warning") -> None:
        self.config = config
        self._log_level = log_level
        self._dir = tempfile.mkdtemp(prefix="pdserve-proxy-")  # 0700: the sockets are the workers' own
        self._mp = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
        self._procs: list[BaseProcess | None] = [None] * config.workers
        self._exits: list[deque[float]] = [deque() for _ in range(config.workers)]
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pdserve-proxy-workers", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def sockets(self) -> list[str]:
        """Each worker's own Unix socket: it answers there from its own state alone (peers.py)."""
        return [socket_path(self._dir, i) for i in range(self.config.workers)]

    @property
    def pids(self) -> list[int | None]:
        return [None if p is None else p.pid for p in self._procs]

    def start(self) -> None:
        """Every worker serves, or ``ProxyStartError`` (and none is left running)."""
        for i in range(self.config.workers):
            self._spawn(i)
        deadline = time.monotonic() + _START_TIMEOUT_S
        try:
            for i, proc in enumerate(self._procs):
                while not self._answers(i):
                    if proc is None or not proc.is_alive():
                        code = None if proc is None else proc.exitcode
                        raise ProxyStartError(f"proxy worker {i} exited while starting (status {code}); "
                                              f"is port {self.config.port} taken?")  # fmt: skip
                    if time.monotonic() > deadline:
                        raise ProxyStartError(
                            f"proxy worker {i} did not answer within {_START_TIMEOUT_S:g} s"
                        )
                    time.sleep(_POLL_S)
        except ProxyStartError:
            self.stop()
            raise
        self._watcher.start()

    def deliver(self, event: InstanceEvent | KVLogEvent) -> None:
        """Hand every worker what the launcher learnt; safe from any thread. A worker that cannot take it
        (restarting) misses it, as a proxy that starts later would."""
        body = orjson.dumps(events.to_dict(event))
        for i, path in enumerate(self.sockets):
            try:
                answer = httpclient.request_unix(path, "POST", "/_pdserve/event", body, PEER_TIMEOUT_S)
            except Unreachable as exc:
                log.warning("proxy worker %d did not take %s %s: %s", i, event.kind, event.url, exc)
                continue
            if answer.status >= 300:
                log.warning("proxy worker %d refused %s %s: %s %s", i, event.kind, event.url, answer.status,
                            answer.body[:300])  # fmt: skip

    def wait(self) -> None:
        """Until ``stop_soon`` or ``stop`` (from a signal handler or another thread)."""
        while not self._stopping.wait(1.0):
            pass

    def stop_soon(self) -> None:
        """Ask ``wait`` to return: nothing is restarted from now on."""
        self._stopping.set()

    def stop(self) -> None:
        self._stopping.set()
        for proc in self._procs:
            if proc is not None and proc.is_alive():
                proc.terminate()  # SIGTERM: uvicorn's graceful shutdown
        for proc in self._procs:
            if proc is not None:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
        if self._watcher.is_alive() and threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _spawn(self, index: int) -> None:
        proc = self._mp.Process(
            target=run_worker,
            args=(self.config, index, self._dir, self._log_level),
            name=f"pdserve-proxy-{index}",
            daemon=True,
        )
        proc.start()
        self._procs[index] = proc

    def _answers(self, index: int) -> bool:
        try:
            path = socket_path(self._dir, index)
            return httpclient.request_unix(path, "GET", "/_pdserve/ready", None, PEER_TIMEOUT_S).status == 200
        except Unreachable:
            return False

    def _watch(self) -> None:
        while not self._stopping.wait(_POLL_S):
            for i, proc in enumerate(self._procs):
                if proc is None or proc.is_alive():
                    continue
                exits = self._exits[i]
                now = time.monotonic()
                exits.append(now)
                while exits and now - exits[0] > _EXIT_WINDOW_S:
                    exits.popleft()
                if len(exits) > _MAX_EXITS:
                    log.error("proxy worker %d exited %d times in %g s: left down; the others serve",
                              i, len(exits), _EXIT_WINDOW_S)  # fmt: skip
                    self._procs[i] = None
                    continue
                log.warning("proxy worker %d exited (status %s); starting it again", i, proc.exitcode)
                if self._stopping.wait(_RESTART_DELAY_S):
                    return
                self._spawn(i)


def serve(config: ProxyConfig, log_level: str = "info") -> None:
    """`pdserve proxy`: run the proxy, in this process or as ``config.workers`` workers, until SIGINT or
    SIGTERM."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.workers == 1:
        server = make_server(config, log_level)
        tune_gc()
        server.run()
        return
    workers = ProxyWorkers(config, log_level)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: workers.stop_soon())
    workers.start()
    log.info("proxy on %s: %d workers", workers.url, config.workers)
    workers.wait()
    workers.stop()
