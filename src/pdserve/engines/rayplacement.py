"""What Ray needs to place a planned instance, and the instance as it runs on the node Ray picked.

Pure: no Ray import, no processes. ``engines/ray_cluster.py`` asks Ray for each instance with
``actor_options`` and, once the actor knows its node's IP, runs ``at_node(spec, ip)``: the instance then
binds that IP, is dialled there, and advertises it as its NIXL side channel (vLLM's default, localhost,
breaks every handshake across nodes; Ray Serve LLM sets the node IP for the same reason).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.config import Role
from pdserve.engines.placement import InstanceSpec
from pdserve.events import InstanceEvent, InstanceEventKind
from pdserve.topology import Topology

# The plan's GPU ids are placeholders under Ray: Ray gives each actor its GPUs and sets the actor's own
# CUDA_VISIBLE_DEVICES, which the instance inherits.
_RAY_OWNED_ENV = ("CUDA_VISIBLE_DEVICES",)
_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"


# Why an instance's actor says nothing: Ray is restarting it, or has given up on it.
# "unresponsive": the actor did not answer in time. Slow is not dead: the proxy's health checks decide.
ActorState = Literal["restarting", "unresponsive", "gone"]


@dataclass(frozen=True)
class NodeInstance:
    """What an instance's actor reports: where it runs and which process serves it."""

    name: str  # the InstanceSpec's name, e.g. prefill-0
    node_ip: str
    url: str  # http://node_ip:port
    pid: int  # the instance's process on that node (its process-group leader)
    log_path: str  # on that node's filesystem


def actor_options(spec: InstanceSpec, topology: Topology) -> dict[str, Any]:
    """``ActorClass.options(...)`` for one instance: the custom resources its role names and, on cuda,
    its GPUs. ``num_cpus=0``: what decides where an instance goes is the resources named here, not
    Ray's CPU bookkeeping (a vLLM instance's cores are its own affair, engines/placement.py)."""
    options: dict[str, Any] = {"num_cpus": 0, "resources": role_resources(topology, spec.role)}
    if topology.device == "cuda":
        options["num_gpus"] = gpus_per_actor(topology)
    return options


def gpus_per_actor(topology: Topology) -> float:
    """GPUs Ray reserves for each instance: gpus_per_instance, 1/instances_per_gpu, or one."""
    if topology.gpus_per_instance is not None:
        return float(topology.gpus_per_instance)
    if topology.instances_per_gpu is not None:
        return 1.0 / topology.instances_per_gpu
    return 1.0


def placeholder_gpu_ids(topology: Topology) -> list[str]:
    """GPU ids for plan_instances under Ray, enough for any placement: the plan needs them to split
    memory between sharers; the ids themselves are dropped by ``at_node``."""
    per_instance = topology.gpus_per_instance or 1
    return [str(i) for i in range(topology.num_instances * max(1, int(per_instance)))]


def at_node(spec: InstanceSpec, node_ip: str) -> InstanceSpec:
    """``spec`` as it runs on the node at ``node_ip``: ``--host`` is that IP, and so are its URL and
    advertised side channel; the GPU ids the plan chose give way to Ray's."""
    args = list(spec.args)
    for i, arg in enumerate(args[:-1]):
        if arg == "--host":
            args[i + 1] = node_ip
    env = tuple(
        (name, node_ip if name == _SIDE_CHANNEL_HOST else value)
        for name, value in spec.env
        if name not in _RAY_OWNED_ENV
    )
    return dataclasses.replace(spec, host=node_ip, args=tuple(args), env=env)


def actor_name(run_id: str, spec: InstanceSpec) -> str:
    """A name unique to this `pdserve up`, so two runs on one cluster never share an actor."""
    return f"pdserve-{run_id}-{spec.name}"


def role_resources(topology: Topology, role: Role) -> dict[str, float]:
    return dict(topology.role(role).resources)


def unplaceable(wanted: Sequence[tuple[str, dict[str, Any]]], nodes: Sequence[dict[str, float]]) -> list[str]:
    """Why some instances cannot be placed: ``wanted`` is (name, actor options) in plan order, ``nodes``
    each live node's total resources (``ray.nodes()``). First fit, each placed instance taking its share
    of its node: without this check an actor Ray cannot place waits for a node forever, silently."""
    free = [dict(node) for node in nodes]
    problems = []
    for name, options in wanted:
        needs = {**options.get("resources", {})}
        if options.get("num_gpus"):
            needs["GPU"] = float(options["num_gpus"])
        fit = next((n for n in free if all(n.get(k, 0.0) >= v for k, v in needs.items())), None)
        if fit is None:
            offered = "; ".join(_describe_node(n) for n in nodes) or "no live node"
            problems.append(f"{name} needs {_describe(needs)}: no node has that left (the nodes: {offered})")
            continue
        for key, amount in needs.items():
            fit[key] -= amount
    return problems


def _describe(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items())) or "nothing"


def _describe_node(resources: dict[str, float]) -> str:
    # Ray's own bookkeeping (node:<ip>, memory, object_store_memory) says nothing about placement here.
    shown = {k: v for k, v in resources.items() if not k.startswith("node:") and "memory" not in k}
    ip = next(
        (k.split(":", 1)[1] for k in resources if k.startswith("node:") and k != "node:__internal_head__"),
        "?",
    )
    return f"{ip}: {_describe(shown)}"


def next_event(
    spec: InstanceSpec,
    url: str,
    before: NodeInstance | None,
    now: NodeInstance | ActorState,
    told: InstanceEventKind | None,
    is_healthy: Callable[[str], bool],
) -> InstanceEvent | None:
    """What to tell the proxy of an instance it knows at ``url``, from what its actor said ``before`` and
    ``now`` and what the proxy was last ``told``: gone (exited), back and healthy (ready, or moved when
    Ray restarted it on another node, hence at another URL), or lost (gave_up)."""
    if now == "gone":
        return InstanceEvent(url, "gave_up", "its Ray actor is gone (restarts spent)")
    if now == "unresponsive":
        return None
    is_new = now == "restarting" or before is None or now.pid != before.pid
    if is_new and told in (None, "ready", "moved"):
        return InstanceEvent(url, "exited", "its Ray actor is restarting")
    if isinstance(now, NodeInstance) and told == "exited" and is_healthy(now.url):
        if now.url != url:
            detail = f"restarted by Ray on node {now.node_ip}, pid {now.pid}"
            return InstanceEvent(url, "moved", detail, new_url=now.url)
        return InstanceEvent(url, "ready", f"restarted by Ray, pid {now.pid}")
    return None
