"""A whole PD system on one host: the vLLM instances of a topology plus the proxy in front of them.

``Stack`` is what `pdserve up`, `pdserve demo` and the end-to-end test fixture share: resolve the engine
venv and model, plan instances, start them (engines/launcher.py), then serve the proxy on a thread of
its own. Leaving the ``with`` block stops the proxy and every instance, whatever happened inside.

With ``topology.on_instance_exit == "restart"`` (the default) a Supervisor restarts instances that exit
and tells the proxy; a LogWatcher follows prefill logs for lease evidence either way. Both feed the
proxy through ``ProxyThread.deliver``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import uvloop

from pdserve import httpclient
from pdserve.config import ProxyConfig, Timeouts, Topology, lease_warnings
from pdserve.engines.launcher import DEFAULT_ENTRYPOINT, EngineGroup
from pdserve.engines.logwatch import LogWatcher
from pdserve.engines.model import ResolvedModel, resolve_model
from pdserve.engines.plan import InstanceSpec, plan_instances, plan_sim_instances, visible_gpus
from pdserve.engines.rayplan import placeholder_gpu_ids
from pdserve.engines.supervisor import RestartPolicy, Supervisor
from pdserve.engines.venv import engine_vllm_version, find_engine_python, version_warning
from pdserve.errors import EngineError
from pdserve.events import InstanceEvent, KVLogEvent
from pdserve.proxy.app import create_app
from pdserve.proxy.server import make_server
from pdserve.proxy.workers import ProxyWorkers
from pdserve.sim.profile import load_profile

if TYPE_CHECKING:
    from pdserve.engines.ray_cluster import RayEngineGroup, RayWatch

_EMBEDDED_MAX_MODEL_LEN = 2048
SIM_ENTRYPOINT = ("-m", "pdserve.sim")
_VLLM_BLOCK_SIZE = {"cpu": 128, "cuda": 16}  # vLLM's default --block-size per device
_PROXY_START_TIMEOUT = 15.0


def new_run_dir(root: str | Path = "runs") -> Path:
    path = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while path.exists():
        suffix += 1
        path = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
    path.mkdir(parents=True)
    return path


class ProxyThread:
    """The proxy served by uvicorn on uvloop in a background thread (signals stay with the main thread)."""

    def __init__(self, config: ProxyConfig, log_level: str = "warning") -> None:
        self.config = config
        self._app = create_app(config)
        self._server = make_server(config, log_level, self._app)
        self._thread = threading.Thread(target=self._run, name="pdserve-proxy", daemon=True)
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _run(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            await self._server.serve()

        try:
            uvloop.run(serve())
        except BaseException as exc:
            self._error = exc

    def deliver(self, event: InstanceEvent | KVLogEvent) -> None:
        """Hand the proxy what the launcher learnt; safe from any thread, a no-op once it stopped."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        state = self._app.state.pdserve.state
        with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
            loop.call_soon_threadsafe(state.on_event, event)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + _PROXY_START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EngineError(f"proxy did not start on {self.url}: {self._error or 'timed out'}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def proxy_for(config: ProxyConfig, log_level: str = "warning") -> ProxyThread | ProxyWorkers:
    """The proxy of ``config``, not yet started: on a thread here, or as its worker processes."""
    return ProxyWorkers(config, log_level) if config.workers > 1 else ProxyThread(config, log_level)


class Stack:
    def __init__(
        self,
        topology: Topology,
        say: Callable[[str], None] = print,
        timeouts: Timeouts | None = None,
        proxy_log_level: str = "warning",
        proxy_options: dict[str, Any] | None = None,
        restart_policy: RestartPolicy | None = None,
    ) -> None:
        self.topology = topology
        self._restart_policy = restart_policy
        self._say = say
        self._timeouts = timeouts or Timeouts()
        self._proxy_log_level = proxy_log_level
        self._proxy_options = dict(proxy_options or {})
        # The simulator is part of pdserve: it runs on this very interpreter, no vLLM venv needed.
        self.engine_python = (
            sys.executable if topology.engine == "sim" else find_engine_python(topology.engine_python)
        )
        self.run_dir = Path(topology.run_dir) if topology.run_dir else new_run_dir()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model: ResolvedModel | None = None
        self.vllm_version: str | None = None  # the engine venv's, learnt at start (None: unknown)
        self.group: EngineGroup | None = None
        self.proxy: ProxyThread | ProxyWorkers | None = None  # workers: config.workers > 1
        self.supervisor: Supervisor | None = None
        self.log_watcher: LogWatcher | None = None
        self.ray_group: RayEngineGroup | None = None  # instead of group, on a Ray cluster (topology.ray)
        self.ray_watch: RayWatch | None = None
        # (time.monotonic(), event), newest last: what the supervisor did, for callers that wait on it
        self.instance_events: deque[tuple[float, InstanceEvent]] = deque(maxlen=256)

    @property
    def specs(self) -> tuple[InstanceSpec, ...]:
        if self.ray_group is not None:
            return self.ray_group.specs
        return self.group.specs if self.group else ()

    def urls(self, role: str) -> list[str]:
        return [s.url for s in self.specs if s.role == role]

    @property
    def proxy_url(self) -> str:
        if self.proxy is None:
            raise RuntimeError("stack not started")
        return self.proxy.url

    def start(self) -> None:
        endpoint = self._proxy_options.get("otlp_traces_endpoint")
        if endpoint and not self.topology.otlp_traces_endpoint:  # one trace: the engines export too
            self.topology = dataclasses.replace(self.topology, otlp_traces_endpoint=endpoint)
        if self.topology.kv_lease_s is not None:  # the ledger's idea of the lease must be the engines'
            self._proxy_options.setdefault("kv_lease_s", self.topology.kv_lease_s)
        if self.topology.engine == "sim":
            specs = plan_sim_instances(self.topology)
            profile = load_profile(self.topology.sim_profile)
            self.model = ResolvedModel(profile.served_model_name, None, False)
            self._proxy_options.setdefault("prefix_block_size", profile.block_size)
            self._say(f"simulator, profile {self.topology.sim_profile}; logs in {self.run_dir}/")
            self._start(specs, SIM_ENTRYPOINT)
            return
        self.vllm_version = engine_vllm_version(self.engine_python)
        warning = version_warning(self.vllm_version, self.engine_python)
        self._say(f"warning: {warning}" if warning else f"vLLM {self.vllm_version} ({self.engine_python})")
        self._say("preparing model ...")
        self.model = resolve_model(self.topology.model, self.engine_python)
        topology = self.topology
        is_cpu = topology.device == "cpu"
        if self.model.is_embedded and is_cpu and not any(a.startswith("--dtype") for a in topology.vllm_args):
            # float32, not vLLM CPU's bf16 default: greedy text must match across CPUs with and without
            # bf16 support, and the equality oracle holds only when every instance uses one dtype.
            # GPUs all do bf16, and Hopper's attention kernels (FA3) take no float32.
            topology = dataclasses.replace(topology, vllm_args=("--dtype", "float32", *topology.vllm_args))
        specs = plan_instances(
            topology,
            self.model.path,
            self.model.served_model_name,
            sorted(os.sched_getaffinity(0)),
            default_max_model_len=_EMBEDDED_MAX_MODEL_LEN if self.model.is_embedded else None,
            # Ray gives each actor its GPUs (and its CUDA_VISIBLE_DEVICES) on the node it picks.
            gpu_ids=placeholder_gpu_ids(topology) if topology.ray else _visible_gpus(),
        )
        self._say(f"model {self.model.served_model_name or self.model.path}; logs in {self.run_dir}/")
        # The proxy counts prompt tokens with the model's own tokenizer (a hub name has none locally).
        self._proxy_options.setdefault(
            "tokenizer", self.model.path if os.path.isdir(self.model.path) else None
        )
        self._proxy_options.setdefault("prefix_block_size", _VLLM_BLOCK_SIZE[self.topology.device])
        self._start(specs, DEFAULT_ENTRYPOINT)

    def _start(self, specs: tuple[InstanceSpec, ...], entrypoint: tuple[str, ...]) -> None:
        if self.topology.ray is not None:
            self._start_on_ray(specs, entrypoint)
            return
        self.group = EngineGroup(
            specs,
            self.engine_python,
            self.run_dir,
            self.topology.startup_timeout,
            on_progress=self._say,
            entrypoint=entrypoint,
        )
        self.group.start()
        self._start_proxy()
        # The simulator's logs are followed too: they cost nothing when they never hold the lines.
        prefill_logs = {s.url: self.group.log_path(s) for s in specs if s.role == "prefill"}
        self.log_watcher = LogWatcher(prefill_logs, self._deliver)
        self.log_watcher.start()
        if self.topology.on_instance_exit == "restart":
            self.supervisor = Supervisor(self.group, self._on_instance_event, self._say, self._restart_policy)
            self.supervisor.start()

    def _start_on_ray(self, specs: tuple[InstanceSpec, ...], entrypoint: tuple[str, ...]) -> None:
        """Each instance a Ray actor on a node with its role's resources; Ray restarts them (no
        Supervisor), RayWatch tells the proxy. Logs are on the nodes, in the same run dir path."""
        try:
            from pdserve.engines.ray_cluster import RayEngineGroup, RayWatch
        except ImportError as exc:
            raise EngineError(f"topology.ray needs Ray: pip install 'pdserve[ray]' ({exc})") from exc
        self._say(f"Ray cluster at {self.topology.ray}")
        self.ray_group = RayEngineGroup(
            specs, self.topology, self.engine_python, self.run_dir, entrypoint, on_progress=self._say
        )
        self.ray_group.start()
        self._start_proxy()
        self.ray_watch = RayWatch(self.ray_group, self._on_instance_event)
        self.ray_watch.start()

    def _start_proxy(self) -> None:
        config = ProxyConfig(
            prefill_urls=tuple(self.urls("prefill")),
            decode_urls=tuple(self.urls("decode")),
            host=self.topology.host,
            port=self.topology.proxy_port,
            timeouts=self._timeouts,
            **self._proxy_options,
        )
        self.proxy = proxy_for(config, self._proxy_log_level)
        self.proxy.start()
        for warning in lease_warnings(config):
            self._say(f"warning: {warning}")

    def _deliver(self, event: InstanceEvent | KVLogEvent) -> None:
        proxy = self.proxy
        if proxy is not None:
            proxy.deliver(event)

    def _on_instance_event(self, event: InstanceEvent) -> None:
        self.instance_events.append((time.monotonic(), event))
        self._deliver(event)

    def stop(self) -> None:
        # Supervision first: nothing may restart an instance that is being stopped.
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self.log_watcher is not None:
            self.log_watcher.stop()
            self.log_watcher = None
        if self.ray_watch is not None:
            self.ray_watch.stop()
            self.ray_watch = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.group is not None:
            self.group.stop()
        if self.ray_group is not None:
            self.ray_group.stop()

    def check_alive(self) -> None:
        """Raise EngineError if an instance exited, unless the supervisor restarts them."""
        if self.group is not None and self.supervisor is None:
            self.group.check_alive()
        if self.ray_group is not None and self.topology.on_instance_exit == "stop":
            gone = [s.name for s in self.ray_group.specs if self.ray_group.poll(s) == "gone"]
            if gone:
                raise EngineError(f"{', '.join(gone)} exited on Ray (on_instance_exit: stop)")

    def describe(self) -> list[str]:
        lines = [f"proxy    {self.proxy_url}   (OpenAI API: {self.proxy_url}/v1)"]
        group = self.ray_group or self.group
        where = "on the Ray node, " if self.ray_group else ""
        for spec in self.specs:
            lines.append(
                f"{spec.role:<8} {spec.url}   NIXL side channel :{spec.side_channel_port}   "
                f"log {where}{group.log_path(spec) if group else '-'}"
            )
        return lines

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _visible_gpus() -> list[str]:
    """GPU ids on an NVIDIA host (from /proc, no driver call), as CUDA_VISIBLE_DEVICES narrows them;
    none on a CPU-only machine."""
    root = Path("/proc/driver/nvidia/gpus")
    num_host_gpus = len(list(root.iterdir())) if root.is_dir() else None
    return visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), num_host_gpus)


def wait_http_ok(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpclient.is_ok(url):
            return True
        time.sleep(0.2)
    return False
