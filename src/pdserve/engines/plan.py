"""Turn a Topology into one InstanceSpec per vLLM instance: ports, CLI arguments, environment.

Pure: no processes, sockets or files. The launcher runs what this plans, and tests check it with plain
values. Prefill instances come first (instance i listens on ``first_port + i``), then decode.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import ROLES, Role, Topology
from pdserve.errors import ConfigError

# Flags the plan owns: a user value would silently break the ports or roles the proxy relies on.
_RESERVED_FLAGS = ("--model", "--host", "--port", "--kv-transfer-config")

Env = tuple[tuple[str, str], ...]

_COMMON_ENV: Env = (
    ("PYTHONUNBUFFERED", "1"),  # log lines reach the log file (and start-up errors) as they happen
    ("HF_HUB_OFFLINE", "1"),  # models are local; a hub lookup would only hang or fail slowly
    ("TRANSFORMERS_OFFLINE", "1"),
    ("VLLM_NO_USAGE_STATS", "1"),
    ("DO_NOT_TRACK", "1"),
)


@dataclass(frozen=True)
class InstanceSpec:
    role: Role
    index: int  # 0.. within its role
    host: str
    port: int  # HTTP (OpenAI API and /health)
    side_channel_port: int  # NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT); decode connects to prefill's
    args: tuple[str, ...]  # vLLM CLI args after `python -m vllm.entrypoints.openai.api_server`
    env: Env  # added to the launcher's environment for this instance

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def plan_instances(
    topology: Topology,
    model_path: str,
    served_model_name: str | None,
    cpu_ids: Sequence[int],
    *,
    default_max_model_len: int | None = None,
    gpu_ids: Sequence[int] = (),
) -> tuple[InstanceSpec, ...]:
    """Plan every instance of ``topology``.

    ``cpu_ids`` are the cores instances may use (``os.sched_getaffinity(0)``), ``gpu_ids`` the GPUs on a
    cuda topology. ``default_max_model_len`` applies when the topology sets none (the embedded model
    needs 2048; other models use their own).
    """
    _check_user_args(topology)
    roles: list[Role] = [r for r in ROLES for _ in range(_count(topology, r))]
    indices = [sum(1 for earlier in roles[:i] if earlier == role) for i, role in enumerate(roles)]
    if topology.device == "cpu":
        device_env = _cpu_env(topology, len(roles), cpu_ids)
    else:
        device_env = _cuda_env(topology, len(roles), gpu_ids)
    max_model_len = topology.max_model_len or default_max_model_len
    specs = []
    for i, (role, index) in enumerate(zip(roles, indices, strict=True)):
        port = topology.first_port + i
        side_channel_port = topology.first_side_channel_port + i
        args = ["--model", model_path]
        if served_model_name:
            args += ["--served-model-name", served_model_name]
        args += ["--host", topology.host, "--port", str(port)]
        if max_model_len is not None:
            args += ["--max-model-len", str(max_model_len)]
        if topology.device == "cpu":
            args.append("--enforce-eager")  # CUDA-graph-style capture buys nothing on CPU and slows start-up
        kv_config = kv_transfer_config(role, topology.device, topology.kv_lease_s, is_both=topology.kv_both)
        args += ["--kv-transfer-config", kv_config]
        args += [*topology.vllm_args, *(topology.prefill_args if role == "prefill" else topology.decode_args)]
        tracing_env: Env = ()
        if topology.otlp_traces_endpoint:
            args += ["--otlp-traces-endpoint", topology.otlp_traces_endpoint]
            tracing_env = (("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),)  # vLLM's default is gRPC
        env = (
            ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(side_channel_port)),
            # The address a peer uses to reach this instance's side channel (decode → prefill).
            ("VLLM_NIXL_SIDE_CHANNEL_HOST", topology.host),
            *_COMMON_ENV,
            *device_env[i],
            *tracing_env,
        )
        specs.append(InstanceSpec(role, index, topology.host, port, side_channel_port, tuple(args), env))
    return tuple(specs)


def plan_sim_instances(topology: Topology) -> tuple[InstanceSpec, ...]:
    """One simulator process per instance (``python -m pdserve.sim``), so losing one behaves like
    losing a real instance; decode pulls KV from prefill over HTTP, as across hosts."""
    specs = []
    roles: list[Role] = [r for r in ROLES for _ in range(_count(topology, r))]
    for i, role in enumerate(roles):
        index = sum(1 for earlier in roles[:i] if earlier == role)
        port = topology.first_port + i
        if topology.kv_both:  # role "both": holds KV for a remote decode, pulls it, or serves whole
            counts = ["--prefill", "0", "--decode", "0", "--both", "1"]
        elif role == "prefill":
            counts = ["--prefill", "1", "--decode", "0"]
        else:
            counts = ["--prefill", "0", "--decode", "1"]
        args = (
            *counts,
            "--host",
            topology.host,
            "--first-port",
            str(port),
            "--profile",
            topology.sim_profile,
        )
        args += (*topology.vllm_args, *(topology.prefill_args if role == "prefill" else topology.decode_args))
        env = (("PYTHONUNBUFFERED", "1"),)
        specs.append(
            InstanceSpec(role, index, topology.host, port, topology.first_side_channel_port + i, args, env)
        )
    return tuple(specs)


def kv_transfer_config(
    role: Role, device: str, kv_lease_s: float | None = None, is_both: bool = False
) -> str:
    """The ``--kv-transfer-config`` JSON: prefill produces KV blocks, decode pulls them; with ``is_both``
    the instance is ``kv_both`` and can do either, or serve a request whole (vLLM's own NIXL tests run
    both sides of a PD pair as ``kv_both``).

    ``kv_lease_s`` sets vLLM's ``kv_lease_duration`` (default 30 s): how long prefill holds KV nobody
    pulls. vLLM 0.32 frees abandoned KV only when the lease runs out, so this is how early it can go.
    Both roles get it: decode heartbeats at a sixth of it to keep leases alive while it pulls.
    """
    config: dict[str, object] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both" if is_both else "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": device,
    }
    if kv_lease_s is not None:
        config["kv_connector_extra_config"] = {"kv_lease_duration": int(kv_lease_s)}
    return json.dumps(config, separators=(",", ":"))


def cpu_list(ids: Sequence[int]) -> str:
    """Sorted ids as a Linux CPU list, the format VLLM_CPU_OMP_THREADS_BIND reads: [0, 1, 2, 5] → "0-2,5"."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(ids)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def _count(topology: Topology, role: Role) -> int:
    return topology.num_prefill if role == "prefill" else topology.num_decode


def _check_user_args(topology: Topology) -> None:
    for field in ("vllm_args", "prefill_args", "decode_args"):
        for arg in getattr(topology, field):
            flag = arg.split("=", 1)[0]
            if flag in _RESERVED_FLAGS:
                raise ConfigError(
                    f"topology.{field} must not set {flag}: pdserve sets it per instance "
                    f"(use the topology's model, host, first_port and roles instead)"
                )


def _cpu_env(topology: Topology, num_instances: int, cpu_ids: Sequence[int]) -> list[Env]:
    """Disjoint cores per instance when there are enough of them; otherwise no binding at all.

    By default every vLLM CPU instance binds spinning OpenMP threads to all cores, so instances sharing
    cores starve each other (seen: P→D answers 20x slower, and KV leases expiring before decode read the
    blocks). With more instances than cores no disjoint split exists; ``nobind`` with one OpenMP thread
    each lets the OS scheduler share them. That fallback is a guess until measured.
    """
    cores = sorted(set(cpu_ids))
    if not cores:
        raise ConfigError("no CPU cores available to run vLLM instances on")
    common = (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_CPU_KVCACHE_SPACE", str(topology.kv_cache_gib)))
    if num_instances > len(cores):
        unbound = (*common, ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("OMP_NUM_THREADS", "1"))
        return [unbound] * num_instances
    # Spread the remainder over the first instances: prefill (compute-bound) comes first.
    per_instance, extra = divmod(len(cores), num_instances)
    envs: list[Env] = []
    start = 0
    for i in range(num_instances):
        size = per_instance + (1 if i < extra else 0)
        envs.append((*common, ("VLLM_CPU_OMP_THREADS_BIND", cpu_list(cores[start : start + size]))))
        start += size
    return envs


def _cuda_env(topology: Topology, num_instances: int, gpu_ids: Sequence[int]) -> list[Env]:
    per_instance = topology.gpus_per_instance
    needed = num_instances * per_instance
    if needed > len(gpu_ids):
        raise ConfigError(
            f"topology needs {needed} GPUs ({num_instances} instances x gpus_per_instance={per_instance}), "
            f"but {len(gpu_ids)} are available"
        )
    slices = [gpu_ids[i * per_instance : (i + 1) * per_instance] for i in range(num_instances)]
    return [(("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in ids)),) for ids in slices]
