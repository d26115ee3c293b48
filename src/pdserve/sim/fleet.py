"""Many sim instances in one process: one uvicorn server per instance, all on one (uv)loop.

Each instance gets its own port, ``SimEngine``, role and engine id; they share one ``KVRegistry``, so a
decode here pulls a prefill's KV here without HTTP. Sockets are bound before the instances are built,
so port 0 works and every instance knows the port it advertises in ``kv_transfer_params``.

    run_sim(specs, profile, faults)       blocks until SIGINT/SIGTERM (what the CLI runs)
    SimCluster(...)                       async start()/stop() on the running loop
    sim_in_thread(...)                    a cluster on its own loop in a thread (tests, benchmarks)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass

import uvicorn

from pdserve.sim.api import create_sim_app
from pdserve.sim.faults import FaultSpec
from pdserve.sim.profile import Profile
from pdserve.sim.replica import SimInstance
from pdserve.sim.transfer import KVRegistry
from pdserve.sim.types import SimRole
from pdserve.sim.wire import DroppedConnectionFilter

log = logging.getLogger("pdserve.sim")

_START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SimInstanceSpec:
    role: SimRole
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port from the OS


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: one process runs many servers and ``run_sim`` owns them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _advertised_host(host: str) -> str:
    """The host a decoder elsewhere should dial: the bound address, or this machine's name for a wildcard."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


class SimCluster:
    def __init__(
        self,
        specs: Sequence[SimInstanceSpec],
        profile: Profile,
        faults: FaultSpec | None = None,
        log_level: str = "warning",
    ) -> None:
        self._specs = tuple(specs)
        self._profile = profile
        self._faults = faults
        self._log_level = log_level
        self.registry = KVRegistry()
        self.instances: list[SimInstance] = []
        self._servers: list[uvicorn.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[socket.socket] = []

    @property
    def urls(self) -> list[str]:
        return [inst.url for inst in self.instances]

    async def start(self) -> None:
        """Bind, build and serve every instance; return once all accept requests."""
        uvicorn_log = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, DroppedConnectionFilter) for f in uvicorn_log.filters):
            uvicorn_log.addFilter(DroppedConnectionFilter())
        for spec in self._specs:
            sock = _bind(spec.host, spec.port)
            self._sockets.append(sock)
            port = sock.getsockname()[1]
            inst = SimInstance.create(
                self._profile, spec.role, _advertised_host(spec.host), port, self.registry, self._faults
            )
            config = uvicorn.Config(
                create_sim_app(inst), http="httptools", lifespan="on", access_log=False, log_config=None,
                log_level=self._log_level, timeout_keep_alive=30, timeout_graceful_shutdown=2,
            )  # fmt: skip
            server = _Server(config)
            self.instances.append(inst)
            self._servers.append(server)
            self._tasks.append(asyncio.create_task(server.serve(sockets=[sock]), name=f"sim-http-{port}"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _START_TIMEOUT_S
        while not all(s.started for s in self._servers):
            failed = [t for t in self._tasks if t.done()]
            if failed or loop.time() > deadline:
                await self.stop()
                raise RuntimeError("a sim instance failed to start; see the log")
            await asyncio.sleep(0.01)

    async def wait(self) -> None:
        """Return when any server stops (normally only after ``stop``)."""
        if self._tasks:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)

    async def stop(self) -> None:
        for server in self._servers:
            server.should_exit = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.close()
        for sock in self._sockets:
            sock.close()


def run_sim(
    specs: Sequence[SimInstanceSpec],
    profile: Profile,
    faults: FaultSpec | None = None,
    log_level: str = "warning",
    on_ready: Callable[[list[SimInstance]], None] | None = None,
) -> None:
    """Serve ``specs`` until SIGINT or SIGTERM; ``on_ready`` sees the instances once all accept requests."""
    import uvloop

    async def main() -> None:
        cluster = SimCluster(specs, profile, faults, log_level)
        await cluster.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(cluster.instances)
        waiter = asyncio.ensure_future(stop.wait())
        exited = asyncio.ensure_future(cluster.wait())
        await asyncio.wait((waiter, exited), return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        exited.cancel()
        await cluster.stop()

    uvloop.run(main())


@contextlib.contextmanager
def sim_in_thread(
    specs: Sequence[SimInstanceSpec],
    profile: Profile,
    faults: FaultSpec | None = None,
    log_level: str = "warning",
) -> Iterator[SimCluster]:
    """A cluster on its own event loop in a daemon thread, as a separate process would be; stopped on exit."""
    import uvloop

    loop = uvloop.new_event_loop()
    cluster = SimCluster(specs, profile, faults, log_level)
    thread = threading.Thread(target=loop.run_forever, name="pdserve-sim", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(cluster.start(), loop).result(_START_TIMEOUT_S)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cluster.stop(), loop).result(_START_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
