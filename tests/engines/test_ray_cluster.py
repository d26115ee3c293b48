"""The pure parts of running on Ray: what each instance asks Ray for, how it is rewritten for the node it
lands on, whether the cluster can place the topology, and the `ray` settings of topology and CLI.
The cluster itself is tested in tests/e2e/test_ray.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.commands import flags
from pdserve.engines.placement import InstanceSpec, plan_instances, plan_sim_instances
from pdserve.engines.rayplacement import (
    ActorState,
    NodeInstance,
    actor_options,
    at_node,
    gpus_per_actor,
    next_event,
    placeholder_gpu_ids,
    unplaceable,
)
from pdserve.errors import ConfigError
from pdserve.events import InstanceEventKind
from pdserve.topology import RoleSpec, Topology
from pdserve.topologyfile import load_topology

RAY = Topology(
    ray="10.0.0.2:6379",
    prefill=RoleSpec(resources=(("pdserve_prefill", 1.0),)),
    decode=RoleSpec(resources=(("pdserve_decode", 1.0),)),
)


def _vllm_specs(topology: Topology, gpu_ids: list[str] | None = None) -> tuple[InstanceSpec, ...]:
    return plan_instances(topology, "/models/m", "m", [0, 1], gpu_ids=gpu_ids or [])


def test_each_role_asks_ray_for_its_own_resources_and_no_cpu() -> None:
    prefill, decode = _vllm_specs(RAY)
    assert actor_options(prefill, RAY) == {"num_cpus": 0, "resources": {"pdserve_prefill": 1.0}}
    assert actor_options(decode, RAY) == {"num_cpus": 0, "resources": {"pdserve_decode": 1.0}}


def test_on_cuda_each_instance_asks_ray_for_its_gpus() -> None:
    whole = Topology(ray="auto", device="cuda", gpus_per_instance=2)
    half = Topology(ray="auto", device="cuda", gpus_per_instance=0.5)
    shared = Topology(ray="auto", device="cuda", instances_per_gpu=4)
    assert [gpus_per_actor(t) for t in (whole, half, shared, Topology(ray="auto", device="cuda"))] == [
        2.0,
        0.5,
        0.25,
        1.0,
    ]
    [prefill, _] = _vllm_specs(half, placeholder_gpu_ids(half))
    assert actor_options(prefill, half)["num_gpus"] == 0.5
    # Sharers still split vLLM's memory budget, as on one host.
    assert "--gpu-memory-utilization" in prefill.args


def test_on_its_node_an_instance_binds_dials_and_advertises_the_node_ip() -> None:
    prefill, _ = _vllm_specs(RAY)
    placed = at_node(prefill, "10.0.0.7")
    assert placed.url == f"http://10.0.0.7:{prefill.port}"
    assert placed.args[placed.args.index("--host") + 1] == "10.0.0.7"
    assert dict(placed.env)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7"
    assert dict(placed.env)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(prefill.side_channel_port)


def test_on_its_node_an_instance_uses_the_gpus_ray_gave_it_not_the_plans() -> None:
    topology = Topology(ray="auto", device="cuda")
    [prefill, _] = _vllm_specs(topology, placeholder_gpu_ids(topology))
    assert "CUDA_VISIBLE_DEVICES" in dict(prefill.env)
    assert "CUDA_VISIBLE_DEVICES" not in dict(at_node(prefill, "10.0.0.7").env)


def test_a_simulated_instance_moves_to_its_node_too() -> None:
    [prefill, _] = plan_sim_instances(Topology(engine="sim", ray="auto"))
    placed = at_node(prefill, "10.0.0.9")
    assert placed.args[placed.args.index("--host") + 1] == "10.0.0.9"
    assert placed.url.startswith("http://10.0.0.9:")


def test_an_instance_no_node_can_hold_is_named_before_anything_starts() -> None:
    topology = Topology(
        ray="auto",
        prefill=RoleSpec(count=2, resources=(("pdserve_prefill", 1.0),)),
        decode=RoleSpec(resources=(("pdserve_decode", 1.0),)),
    )
    wanted = [(s.name, actor_options(s, topology)) for s in _vllm_specs(topology)]
    head = {"CPU": 1.0, "pdserve_prefill": 1.0, "node:10.0.0.2": 1.0, "memory": 1e9}
    worker = {"CPU": 1.0, "pdserve_decode": 1.0, "node:10.0.0.3": 1.0}
    [problem] = unplaceable(wanted, [head, worker])
    assert problem.startswith("prefill-1 needs pdserve_prefill=1: no node has that left")
    assert "10.0.0.2: CPU=1, pdserve_prefill=1" in problem  # what the nodes offer, without Ray's bookkeeping
    assert unplaceable(wanted, [head, head, worker]) == []


def test_gpus_count_towards_placement() -> None:
    topology = Topology(ray="auto", device="cuda")
    specs = _vllm_specs(topology, placeholder_gpu_ids(topology))
    wanted = [(s.name, actor_options(s, topology)) for s in specs]
    assert len(unplaceable(wanted, [{"GPU": 1.0}])) == 1
    assert unplaceable(wanted, [{"GPU": 1.0}, {"GPU": 1.0}]) == []


def test_topology_file_takes_the_ray_address_and_resources_per_role(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "ray: 10.0.0.2:6379\nprefill: {count: 2, resources: {pdserve_prefill: 1}}\n"
        "decode: {resources: {pdserve_decode: 0.5, GPU: 1}}\n"
    )
    topology = load_topology(path)
    assert topology.ray == "10.0.0.2:6379"
    assert topology.prefill.resources == (("pdserve_prefill", 1.0),)
    assert topology.decode.resources == (("GPU", 1.0), ("pdserve_decode", 0.5))


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("prefill: {resources: {pdserve_prefill: 1}}\n", "need topology.ray"),
        ("ray: auto\nprefill: {resources: {pdserve_prefill: 0}}\n", "amount > 0"),
        ("ray: auto\nprefill: {resources: [pdserve_prefill]}\n", "must be a mapping"),
        ("ray: auto\nprefill: {resources: {pdserve_prefill: lots}}\n", "must be a number"),
        ("ray: auto\nprefill: {hosts: [10.0.0.5]}\n", "at the IP of the node"),
        ("ray: ''\n", "must be a Ray address"),
    ],
)
def test_a_bad_ray_setting_is_refused_with_what_to_do(tmp_path: Path, yaml_text: str, message: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_topology(path)


def test_up_takes_ray_and_resources_from_flags() -> None:
    parser = argparse.ArgumentParser()
    flags.add_topology(parser)
    args = parser.parse_args(
        ["--ray", "auto", "--prefill-resource", "pdserve_prefill=1", "--decode-resource", "pdserve_decode=2"]
    )
    topology = flags.topology_from_args(args)
    assert (topology.ray, topology.prefill.resources, topology.decode.resources) == (
        "auto",
        (("pdserve_prefill", 1.0),),
        (("pdserve_decode", 2.0),),
    )


def _node(pid: int, url: str = "http://10.0.0.3:8101") -> NodeInstance:
    return NodeInstance("decode-0", "10.0.0.3", url, pid, "/runs/decode-0.log")


def _story(*polls: NodeInstance | ActorState, healthy: bool = True) -> list[str]:
    """The events the proxy hears, poll after poll, as RayWatch feeds them."""
    spec = at_node(_vllm_specs(RAY)[1], "10.0.0.3")
    before: NodeInstance | None = _node(1)
    told: InstanceEventKind | None = None
    url = spec.url
    heard = []
    for now in polls:
        event = next_event(spec, url, before, now, told, lambda _url: healthy)
        if isinstance(now, NodeInstance):
            before = now
        if event is not None:
            assert event.url == url  # always the URL the proxy knows it by
            told = event.kind
            heard.append(event.kind if event.kind != "moved" else f"moved to {event.new_url}")
            url = event.new_url or url
    return heard


def test_the_proxy_hears_an_instance_go_and_come_back_each_time_ray_restarts_it() -> None:
    assert _story(_node(1), _node(1)) == []
    assert _story("restarting", "restarting", _node(2), _node(2)) == ["exited", "ready"]
    # A restart quicker than one poll: only the new pid tells.
    assert _story(_node(2), _node(2)) == ["exited", "ready"]
    assert _story("restarting", _node(2), "restarting", _node(3)) == ["exited", "ready", "exited", "ready"]
    assert _story("restarting", _node(2), _node(2), healthy=False) == ["exited"]


def test_an_actor_too_busy_to_answer_in_time_is_not_reported_gone() -> None:
    # A loaded node answers late: the proxy's own health checks, not one slow Ray call, take it out.
    assert _story(_node(1), "unresponsive", "unresponsive", _node(1)) == []
    assert _story("restarting", "unresponsive", _node(2)) == ["exited", "ready"]


def test_the_proxy_hears_that_an_instance_is_lost_when_ray_gives_up() -> None:
    assert _story("restarting", "gone") == ["exited", "gave_up"]


def test_the_proxy_hears_where_an_instance_serves_when_ray_restarts_it_on_another_node() -> None:
    elsewhere = "http://10.0.0.9:8101"
    assert _story("restarting", _node(2, url=elsewhere)) == ["exited", f"moved to {elsewhere}"]
    assert _story("restarting", _node(2, url=elsewhere), healthy=False) == ["exited"]  # not until it serves
    # Restarted again, on its new node: the proxy knows it there now.
    story = _story("restarting", _node(2, url=elsewhere), "restarting", _node(3, url=elsewhere))
    assert story == ["exited", f"moved to {elsewhere}", "exited", "ready"]
