"""Turn a Topology into one InstanceSpec per vLLM instance: ports, CLI arguments, environment.

Pure: no processes, sockets or files. The launcher runs what this plans, and tests check it with plain
values. Prefill instances come first (instance i listens on ``first_port + i``), then decode; an elastic
pool's instances (role "elastic") are the only ones of their topology.

On GPUs instance i goes to GPU ``i // instances_per_gpu`` of the visible ones (so the 1P1D demo on one
GPU puts both there). Instances that share a GPU split vLLM's memory budget and start one after the
other (``start_stage``): started together, one of them dies in vLLM's memory profiling, which reads
another process's allocations as its own ("Error in memory profiling").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import Role
from pdserve.errors import ConfigError
from pdserve.topology import KVTransfer, Topology

# Flags the plan owns: a user value would silently break the ports or roles the proxy relies on.
_RESERVED_FLAGS = ("--model", "--host", "--port", "--kv-transfer-config")
_GPU_MEMORY_FLAG = "--gpu-memory-utilization"
_KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}  # NixlConnector's kv_role
# An instance that takes any role per request (an elastic pool's, or every one of a kv_both topology).
# vLLM 0.32's pull NixlConnector never reads kv_role on a request's path: kv_transfer_params alone say
# whether to hold KV for a remote decode, pull it, or serve whole. The role matters to two scheduler
# guards, and only with overlapping batches: a consumer defers freeing blocks a pull may still fill, a
# producer drops the output of a request preempted mid-handoff. kv_both has both guards but is deprecated
# for NixlConnector, so these instances are consumers (pulling, the common case, keeps its guard), and on
# cuda run without async scheduling, where no batches overlap and neither guard is needed (the CPU
# platform turns async scheduling off itself).
_ANY_ROLE_KV = "kv_consumer"
# vLLM's connector per transfer mode: NixlConnector is vLLM's alias of NixlPullConnector (nixl/connector.py)
_CONNECTORS: dict[KVTransfer, str] = {"pull": "NixlConnector", "push": "NixlPushConnector"}
_VLLM_LEASE_S = 30  # vLLM's kv_lease_duration when none is given (nixl/base_scheduler.py)
_NO_ASYNC_SCHEDULING = "--no-async-scheduling"
_ASYNC_SCHEDULING_FLAGS = ("--async-scheduling", _NO_ASYNC_SCHEDULING)
# Every instance reports usage.prompt_tokens_details.cached_tokens: on a decode, the prompt tokens it did
# not compute itself, the per-request proof that the prompt's KV came over NIXL (docs/kv-integrity.md).
# Every role, because an instance of any role may decode. The simulator takes the same flag.
PROMPT_TOKENS_DETAILS_FLAG = "--enable-prompt-tokens-details"
_VLLM_GPU_MEMORY_PERCENT = 90  # vLLM's default --gpu-memory-utilization, split between sharers

Env = tuple[tuple[str, str], ...]

_COMMON_ENV: Env = (
    ("PYTHONUNBUFFERED", "1"),  # log lines reach the log file (and start-up errors) as they happen
    ("HF_HUB_OFFLINE", "1"),  # models are local; a hub lookup would only hang or fail slowly
    ("TRANSFORMERS_OFFLINE", "1"),
    ("VLLM_NO_USAGE_STATS", "1"),
    ("DO_NOT_TRACK", "1"),
)


# UCX turns cuda_ipc GET (what a NIXL READ, i.e. decode pulling prefill's KV, uses) off when NVML reports no
# NVLink on GPU 0 ("cuda-ipc get zcopy disabled as no nvlinks detected"), and READ then falls back to a
# software GET over tcp/lo. Two instances on one H200 (docs/gpu.md): 0.5 GB/s before, 0.8-1.2 TB/s after,
# PD TTFT p50 10.1 s → 0.55 s. Forcing it on is harmless elsewhere: with NVLink UCX turns it on anyway,
# and across hosts cuda_ipc is not reachable.
_CUDA_ENV: Env = (("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y"),)

# NIXL's progress thread polls without pause, a core per instance (engines/enginesite/sitecustomize.py); on
# a CPU host those cores are the engines' own, so the thread waits this long between polls there.
CPU_NIXL_PROGRESS_DELAY_US = 100
NIXL_PROGRESS_DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"

# A late pull (decode reading KV prefill had released) leaves wrong blocks in decode's prefix cache, where
# later requests with that prefix would reuse them; the proxy's lease guard then empties that cache with
# POST /reset_prefix_cache, which vLLM serves only in dev mode (docs/kv-integrity.md).
_DECODE_ENV: Env = (("VLLM_SERVER_DEV_MODE", "1"),)


@dataclass(frozen=True)
class GpuSlot:
    """Where one instance runs on a GPU host."""

    visible_devices: str  # its CUDA_VISIBLE_DEVICES: ids (or UUIDs) of the host's devices, comma-separated
    num_sharers: int  # instances planned per GPU: 1, or N when N instances share one
    start_stage: int  # its place among the instances of its GPU: 0 starts first


@dataclass(frozen=True)
class InstanceSpec:
    role: Role
    index: int  # 0.. within its role
    host: str
    port: int  # HTTP (OpenAI API and /health)
    side_channel_port: int  # NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT); decode connects to prefill's
    args: tuple[str, ...]  # vLLM CLI args after `python -m vllm.entrypoints.openai.api_server`
    env: Env  # added to the launcher's environment for this instance
    # The launcher starts stage 0, waits until it is healthy, then stage 1, ...: instances sharing a GPU
    # get consecutive stages. Instances on their own cores or GPUs are all stage 0 (started together).
    start_stage: int = 0
    # Run before the command, e.g. ("ip", "netns", "exec", "ns1"): the instance then lives where the
    # prefix puts it, and its ports are not this namespace's to probe. It must exec the command (the
    # launcher signals the prefix's process group to stop the instance).
    command_prefix: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def gpus(self) -> frozenset[str]:
        """The host GPUs it runs on (its CUDA_VISIBLE_DEVICES); empty on a CPU host."""
        visible = dict(self.env).get("CUDA_VISIBLE_DEVICES", "")
        return frozenset(g.strip() for g in visible.split(",") if g.strip())


def plan_instances(
    topology: Topology,
    model_path: str,
    served_model_name: str | None,
    cpu_ids: Sequence[int],
    *,
    default_max_model_len: int | None = None,
    gpu_ids: Sequence[int | str] = (),
) -> tuple[InstanceSpec, ...]:
    """Plan every instance of ``topology``.

    ``cpu_ids`` are the cores instances may use (``os.sched_getaffinity(0)``), ``gpu_ids`` the visible
    GPUs on a cuda topology, in order (``visible_gpus``). ``default_max_model_len`` applies when the
    topology sets none (the embedded model needs 2048; other models use their own).
    """
    _check_user_args(topology)
    roles, indices = _instance_roles(topology)
    slots: list[GpuSlot] = []
    if topology.device == "cpu":
        device_env = _cpu_env(topology, len(roles), cpu_ids)
    else:
        slots = place_on_gpus(topology, len(roles), gpu_ids)
        device_env = [(("CUDA_VISIBLE_DEVICES", slot.visible_devices), *_CUDA_ENV) for slot in slots]
    delay_us = topology.nixl_progress_delay_us
    if delay_us is None:
        delay_us = CPU_NIXL_PROGRESS_DELAY_US if topology.device == "cpu" else 0
    nixl_env: Env = ((NIXL_PROGRESS_DELAY_ENV, str(delay_us)),) if delay_us else ()
    max_model_len = topology.max_model_len or default_max_model_len
    hosts = topology.instance_hosts
    specs = []
    for i, (role, index) in enumerate(zip(roles, indices, strict=True)):
        port = topology.first_port + i
        side_channel_port = topology.first_side_channel_port + i
        args = ["--model", model_path]
        if served_model_name:
            args += ["--served-model-name", served_model_name]
        args += ["--host", _bind_host(topology, i), "--port", str(port)]
        if max_model_len is not None:
            args += ["--max-model-len", str(max_model_len)]
        if topology.device == "cpu":
            args.append("--enforce-eager")  # CUDA-graph-style capture buys nothing on CPU and slows start-up
        role_args = topology.vllm_args_for(role)
        if slots and slots[i].num_sharers > 1 and not _sets_flag(role_args, _GPU_MEMORY_FLAG):
            # vLLM's share is of the whole GPU's memory: sharers must split it or the second cannot start.
            args += [_GPU_MEMORY_FLAG, gpu_memory_share(slots[i].num_sharers)]
        is_any = _takes_any_role(topology, role)
        kv_config = kv_transfer_config(
            role, topology.device, topology.kv_lease_s, is_any_role=is_any, transfer=topology.kv_transfer
        )
        args += ["--kv-transfer-config", kv_config]
        if not _sets_flag(role_args, PROMPT_TOKENS_DETAILS_FLAG):
            args.append(PROMPT_TOKENS_DETAILS_FLAG)
        if (
            is_any
            and topology.device == "cuda"
            and not any(_sets_flag(role_args, f) for f in _ASYNC_SCHEDULING_FLAGS)
        ):
            args.append(_NO_ASYNC_SCHEDULING)
        args += role_args
        tracing_env: Env = ()
        if topology.otlp_traces_endpoint:
            args += ["--otlp-traces-endpoint", topology.otlp_traces_endpoint]
            tracing_env = (
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),  # vLLM's default is gRPC
                # vLLM names no service: without this every instance's spans are "unknown_service".
                ("OTEL_SERVICE_NAME", f"vllm-{role}-{index}"),
            )
        env = (
            ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(side_channel_port)),
            # vLLM binds the side channel's ZMQ socket to this address and puts the same string into
            # prefill's kv_transfer_params as remote_host, the address decode dials: it must be one the
            # peers can reach, never a wildcard (decode would dial itself) nor, across hosts, loopback.
            ("VLLM_NIXL_SIDE_CHANNEL_HOST", hosts[i]),
            *_COMMON_ENV,
            *device_env[i],
            *nixl_env,
            *tracing_env,
            *(_DECODE_ENV if role != "prefill" else ()),
        )
        stage = slots[i].start_stage if slots else 0
        specs.append(InstanceSpec(role, index, hosts[i], port, side_channel_port, tuple(args), env, stage))
    return tuple(specs)


def _bind_host(topology: Topology, i: int) -> str:
    """Where instance ``i``'s HTTP server listens: its own address, or a wildcard ``host`` as given
    (reachable on every interface; the proxy and the side channel still use 127.0.0.1)."""
    return topology.instance_hosts[i] if topology.has_own_hosts else topology.host


def plan_sim_instances(topology: Topology) -> tuple[InstanceSpec, ...]:
    """One simulator process per instance (``python -m pdserve.sim``), so losing one behaves like
    losing a real instance; decode pulls KV from prefill over HTTP, as across hosts."""
    specs = []
    roles, indices = _instance_roles(topology)
    hosts = topology.instance_hosts
    for i, (role, index) in enumerate(zip(roles, indices, strict=True)):
        port = topology.first_port + i
        if _takes_any_role(topology, role):  # "both": holds KV for a remote decode, pulls it, or serves whole
            counts = ["--prefill", "0", "--decode", "0", "--both", "1"]
        elif role == "prefill":
            counts = ["--prefill", "1", "--decode", "0"]
        else:
            counts = ["--prefill", "0", "--decode", "1"]
        args = (
            *counts,
            "--host",
            _bind_host(topology, i),
            "--first-port",
            str(port),
            "--profile",
            topology.sim_profile,
        )
        if topology.kv_lease_s is not None:
            args += ("--kv-lease-s", f"{topology.kv_lease_s:g}")
        role_args = topology.vllm_args_for(role)
        if not _sets_flag(role_args, PROMPT_TOKENS_DETAILS_FLAG):
            args += (PROMPT_TOKENS_DETAILS_FLAG,)
        args += role_args
        env = (("PYTHONUNBUFFERED", "1"),)
        specs.append(
            InstanceSpec(role, index, hosts[i], port, topology.first_side_channel_port + i, args, env)
        )
    return tuple(specs)


def kv_transfer_config(
    role: Role,
    device: str,
    kv_lease_s: float | None = None,
    is_any_role: bool = False,
    transfer: KVTransfer = "pull",
) -> str:
    """The ``--kv-transfer-config`` JSON: prefill produces KV blocks, decode pulls them; an instance of
    any role (``is_any_role``, role "elastic") does either per request, or serves it whole, as a consumer
    (``_ANY_ROLE_KV``: why).

    ``kv_lease_s`` sets vLLM's ``kv_lease_duration`` (default 30 s): how long prefill holds KV nobody
    pulls. vLLM 0.32 frees abandoned KV only when the lease runs out, so this is how early it can go.
    Both roles get it: decode heartbeats at a sixth of it to keep leases alive while it pulls.

    ``transfer`` push names vLLM's ``NixlPushConnector`` (prefill WRITEs into blocks decode registered)
    and sets its registration watchdog, ``push_registration_timeout``, to the lease: vLLM's default is
    ``decoder_kv_blocks_ttl`` (480 s), and a registration nobody fulfils is worth a warning in the log
    long before that (docs/handover.md: the watchdog only warns; it frees nothing).
    """
    extra: dict[str, object] = {}
    if kv_lease_s is not None:
        extra["kv_lease_duration"] = int(kv_lease_s)
    if transfer == "push":
        extra["push_registration_timeout"] = int(kv_lease_s or _VLLM_LEASE_S)
    config: dict[str, object] = {
        "kv_connector": _CONNECTORS[transfer],
        "kv_role": _ANY_ROLE_KV if is_any_role or role == "elastic" else _KV_ROLES[role],
        "kv_buffer_device": device,
    }
    if extra:
        config["kv_connector_extra_config"] = extra
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


def _instance_roles(topology: Topology) -> tuple[list[Role], list[int]]:
    """Each instance's role and its index within the role, in plan order (prefill first)."""
    roles = [name for name, spec in topology.roles() for _ in range(spec.count)]
    indices = [index for _, spec in topology.roles() for index in range(spec.count)]
    return roles, indices


def _takes_any_role(topology: Topology, role: Role) -> bool:
    return role == "elastic" or topology.kv_both


def _sets_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg.split("=", 1)[0] == flag for arg in args)


def _check_user_args(topology: Topology) -> None:
    given = [("vllm_args", topology.vllm_args)]
    given += [(f"{name}.args", spec.args) for name, spec in topology.roles()]
    for field, args in given:
        for arg in args:
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


def gpu_memory_share(num_sharers: int) -> str:
    """vLLM's default 0.9 of GPU memory split between ``num_sharers``, rounded down: 2 → "0.45"."""
    return f"{_VLLM_GPU_MEMORY_PERCENT // num_sharers / 100:.2f}"


def visible_gpus(cuda_visible_devices: str | None, num_host_gpus: int | None) -> list[str]:
    """The GPUs pdserve may use, as ids for the instances' own CUDA_VISIBLE_DEVICES.

    A child's CUDA_VISIBLE_DEVICES is read against the host's devices, not the parent's view, so with
    ``CUDA_VISIBLE_DEVICES=3,5`` the instances get "3" and "5", in that order. As CUDA does, the list
    ends at the first entry that is neither an index nor a UUID (``GPU-…``, ``MIG-…``); set but empty
    hides every GPU. Unset: all ``num_host_gpus`` (None: unknown, i.e. none unless the variable names them).
    """
    if cuda_visible_devices is None:
        return [str(i) for i in range(num_host_gpus or 0)]
    ids: list[str] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        is_index = entry.isdigit() and (num_host_gpus is None or int(entry) < num_host_gpus)
        if not (is_index or entry.startswith(("GPU-", "MIG-"))):
            break
        ids.append(entry)
    return ids


def place_on_gpus(topology: Topology, num_instances: int, gpu_ids: Sequence[int | str]) -> list[GpuSlot]:
    """One GpuSlot per instance, in instance order. ConfigError when the visible GPUs do not suffice."""
    gpus = [str(g) for g in gpu_ids]
    seen = f"visible GPUs: {', '.join(gpus)}" if gpus else "no GPU is visible (CUDA_VISIBLE_DEVICES, driver)"
    per_instance, per_gpu = topology.gpus_per_instance, topology.instances_per_gpu
    if per_instance is not None and per_instance >= 1:
        whole = int(per_instance)
        needed = num_instances * whole
        if needed > len(gpus):
            raise ConfigError(
                f"topology needs {needed} GPUs ({num_instances} instances x gpus_per_instance={whole}), "
                f"but {len(gpus)} are available ({seen})"
            )
        return [GpuSlot(",".join(gpus[i * whole : (i + 1) * whole]), 1, 0) for i in range(num_instances)]
    if per_instance is not None:
        per_gpu = round(1 / per_instance)
    elif per_gpu is None:  # neither set: one GPU each if there are enough, else share them evenly
        if not gpus:
            raise ConfigError(f"topology.device is cuda but {seen}")
        per_gpu = math.ceil(num_instances / len(gpus))
    needed = math.ceil(num_instances / per_gpu)
    if needed > len(gpus):
        raise ConfigError(
            f"topology needs {needed} GPUs ({num_instances} instances, {per_gpu} per GPU), "
            f"but {len(gpus)} are available ({seen})"
        )
    return [GpuSlot(gpus[i // per_gpu], per_gpu, i % per_gpu) for i in range(num_instances)]
