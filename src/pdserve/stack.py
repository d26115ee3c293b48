"""A whole PD system: the vLLM instances of a topology plus the proxy in front of them.

``Stack`` is what `pdserve up`, `pdserve demo`, `pdserve bench --compare` and the end-to-end test fixture
share: resolve the engine venv and model, plan instances, start them on an engine backend (processes on
this host, or Ray actors: engines/backend.py), then serve the proxy on a thread of its own
(proxy/serving/thread.py), its config built once from the settings given and what the engines tell. Leaving the
``with`` block stops the proxy and every instance, whatever happened inside.

Once the proxy serves, the backend watches the instances (restarts, Ray's restarts, lease evidence in
the logs) and tells the proxy through ``deliver``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from pdserve import httpclient
from pdserve.config import ProxySettings, lease_warnings
from pdserve.engines.backend import EngineBackend, LocalEngines
from pdserve.engines.launcher import DEFAULT_ENTRYPOINT, EngineGroup
from pdserve.engines.model import ResolvedModel, model_kv_shape, resolve_model
from pdserve.engines.placement import InstanceSpec, plan_instances, plan_sim_instances, visible_gpus
from pdserve.engines.rayplacement import placeholder_gpu_ids
from pdserve.engines.supervisor import RestartPolicy
from pdserve.engines.venv import engine_vllm_version, find_engine_python, version_warning
from pdserve.errors import EngineError, Unreachable
from pdserve.events import InstanceEvent, KVLogEvent
from pdserve.proxy.serving.peers import PARTIAL_HEADER
from pdserve.proxy.serving.thread import ProxyThread, proxy_for
from pdserve.proxy.serving.workers import ProxyWorkers
from pdserve.sim.profile import load_profile
from pdserve.topology import Topology
from pdserve.tppairing import KVShape, block_size

_EMBEDDED_MAX_MODEL_LEN = 2048
SIM_ENTRYPOINT = ("-m", "pdserve.sim")
_VLLM_BLOCK_SIZE = {"cpu": 128, "cuda": 16}  # vLLM's default --block-size per device


def prefix_block_size(topology: Topology) -> int:
    """The block the proxy's prefix affinity hashes prompts in: the one prefill caches them in, its
    ``--block-size`` if the topology sets one, else vLLM's default on the device."""
    return block_size(topology.vllm_args_for("prefill")) or _VLLM_BLOCK_SIZE[topology.device]


def new_run_dir(root: str | Path = "runs") -> Path:
    path = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while path.exists():
        suffix += 1
        path = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
    path.mkdir(parents=True)
    return path


class Stack:
    """The instances of ``topology`` on an engine backend, and the proxy in front of them.

    ``proxy`` is how the proxy behaves; its instances, host and port come from the topology, and what
    only the started engines know (their KV lease, block size and tokenizer) from them."""

    def __init__(
        self,
        topology: Topology,
        say: Callable[[str], None] = print,
        proxy: ProxySettings | None = None,
        proxy_log_level: str = "warning",
        restart_policy: RestartPolicy | None = None,
    ) -> None:
        self.topology = topology
        self._say = say
        self._settings = proxy or ProxySettings()
        self._proxy_log_level = proxy_log_level
        self._restart_policy = restart_policy
        # The simulator is part of pdserve: it runs on this very interpreter, no vLLM venv needed.
        self.engine_python = (
            sys.executable if topology.engine == "sim" else find_engine_python(topology.engine_python)
        )
        self.run_dir = Path(topology.run_dir) if topology.run_dir else new_run_dir()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model: ResolvedModel | None = None
        self.vllm_version: str | None = None  # the engine venv's, learnt at start (None: unknown)
        self.engines: EngineBackend | None = None
        self.proxy: ProxyThread | ProxyWorkers | None = None  # workers: config.workers > 1
        # (time.monotonic(), event), newest last: what the supervisor did, for callers that wait on it
        self.instance_events: deque[tuple[float, InstanceEvent]] = deque(maxlen=256)

    @property
    def specs(self) -> tuple[InstanceSpec, ...]:
        return self.engines.specs if self.engines is not None else ()

    @property
    def group(self) -> EngineGroup:
        """The instances' processes on this host, for what acts on them directly (tests and benchmarks
        that kill or stall one); EngineError on Ray or before ``start``."""
        if not isinstance(self.engines, LocalEngines):
            raise EngineError("the instances are not processes of this host (on Ray, or not started)")
        return self.engines.group

    def urls(self, role: str) -> list[str]:
        return [s.url for s in self.specs if s.role == role]

    @property
    def proxy_url(self) -> str:
        if self.proxy is None:
            raise RuntimeError("stack not started")
        return self.proxy.url

    def start(self) -> None:
        settings = self._settings
        endpoint = settings.otlp_traces_endpoint
        if endpoint and not self.topology.otlp_traces_endpoint:  # one trace: the engines export too
            self.topology = dataclasses.replace(self.topology, otlp_traces_endpoint=endpoint)
        if self.topology.kv_lease_s is not None:  # the ledger's idea of the lease must be the engines'
            settings = dataclasses.replace(settings, kv_lease_s=self.topology.kv_lease_s)
        if self.topology.engine == "sim":
            specs = plan_sim_instances(self.topology)
            profile = load_profile(self.topology.sim_profile)
            self._check_tp_pairing(profile.kv_shape, profile.tensor_parallel_size)
            self.model = ResolvedModel(profile.served_model_name, None, False)
            routing = dataclasses.replace(settings.routing, prefix_block_size=profile.block_size)
            self._say(f"simulator, profile {self.topology.sim_profile}; logs in {self.run_dir}/")
            self._start(specs, SIM_ENTRYPOINT, dataclasses.replace(settings, routing=routing))
            return
        self.vllm_version = engine_vllm_version(self.engine_python)
        warning = version_warning(self.vllm_version, self.engine_python)
        self._say(f"warning: {warning}" if warning else f"vLLM {self.vllm_version} ({self.engine_python})")
        self._say("preparing model ...")
        self.model = resolve_model(self.topology.model, self.engine_python)
        # Only now are the model's KV heads known (its config.json): the pairing rules that need them.
        self._check_tp_pairing(model_kv_shape(self.model.path))
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
        tokenizer = settings.routing.tokenizer
        if tokenizer is None and os.path.isdir(self.model.path):
            tokenizer = self.model.path
        routing = dataclasses.replace(
            settings.routing, tokenizer=tokenizer, prefix_block_size=prefix_block_size(self.topology)
        )
        self._start(specs, DEFAULT_ENTRYPOINT, dataclasses.replace(settings, routing=routing))

    def _check_tp_pairing(self, shape: KVShape, default_tp: int = 1) -> None:
        """ConfigError before any instance starts when vLLM cannot pair the roles' tensor-parallel sizes
        for this model (vLLM would fail every pull at decode's NIXL handshake); a heterogeneous pair it
        supports is said, with how decode's ranks read prefill's."""
        pairing = self.topology.tp_pairing(shape, default_tp)
        if pairing is not None and pairing.tp_ratio != 1:
            self._say(f"tensor parallel: {pairing.describe()}")

    def _start(
        self, specs: tuple[InstanceSpec, ...], entrypoint: tuple[str, ...], proxy: ProxySettings
    ) -> None:
        self.engines = self._backend(specs, entrypoint)
        self.engines.start()
        # A pool per role the topology starts: prefill and decode, or an elastic pool.
        config = proxy.fronting(
            {role: self.urls(role) for role, _ in self.topology.roles()},
            host=self.topology.host,
            port=self.topology.proxy_port,
        )
        self.proxy = proxy_for(config, self._proxy_log_level)
        self.proxy.start()
        for warning in lease_warnings(config):
            self._say(f"warning: {warning}")
        self.engines.watch(self._on_event, self._in_flight_at)

    def _backend(self, specs: tuple[InstanceSpec, ...], entrypoint: tuple[str, ...]) -> EngineBackend:
        topology = self.topology
        if topology.ray is None:
            group = EngineGroup(
                specs, self.engine_python, self.run_dir, topology.startup_timeout, self._say, entrypoint
            )
            return LocalEngines(group, topology.on_instance_exit, self._say, self._restart_policy)
        try:
            from pdserve.engines.ray_cluster import RayEngineGroup, RayEngines
        except ImportError as exc:
            raise EngineError(f"topology.ray needs Ray: pip install 'pdserve[ray]' ({exc})") from exc
        self._say(f"Ray cluster at {topology.ray}")
        group_on_ray = RayEngineGroup(
            specs, topology, self.engine_python, self.run_dir, entrypoint, on_progress=self._say
        )
        return RayEngines(group_on_ray, topology)

    def _on_event(self, event: InstanceEvent | KVLogEvent) -> None:
        if isinstance(event, InstanceEvent):
            self.instance_events.append((time.monotonic(), event))
        proxy = self.proxy
        if proxy is not None:
            proxy.deliver(event)

    def _in_flight_at(self, url: str) -> int | None:
        """The requests every proxy worker has in flight at instance ``url``; None when that is not
        known for sure (no proxy, no answer, or an answer lacking a worker's part)."""
        proxy = self.proxy
        if proxy is None:
            return None
        try:
            response = httpclient.get(f"{proxy.url}/instances", timeout=2.0)
            described = json.loads(response.body) if response.status == 200 else None
        except (Unreachable, ValueError):
            return None
        if not isinstance(described, list) or PARTIAL_HEADER.lower() in response.headers:
            return None
        counts = [d.get("in_flight") for d in described if isinstance(d, dict) and d.get("url") == url]
        return counts[0] if len(counts) == 1 and isinstance(counts[0], int) else None

    def stop(self) -> None:
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            proxy.stop()
        if self.engines is not None:
            self.engines.stop()

    def check_alive(self) -> None:
        """Raise EngineError if an instance exited and nothing brings it back (on_instance_exit: stop)."""
        if self.engines is not None:
            self.engines.check_alive()

    def describe(self) -> list[str]:
        lines = [f"proxy    {self.proxy_url}   (OpenAI API: {self.proxy_url}/v1)"]
        for spec in self.specs:
            where = self.engines.log_place(spec) if self.engines is not None else "-"
            lines.append(
                f"{spec.role:<8} {spec.url}   NIXL side channel :{spec.side_channel_port}   log {where}"
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
