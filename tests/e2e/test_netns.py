"""Prefill and decode on different "hosts": real vLLM in two network namespaces, the proxy in the root
namespace, joined by one bridge (tests/e2e/netns.py). Each namespace has its own loopback and one
address, so the KV can only have moved if decode dialled the address prefill advertised, across the
bridge: a loopback shortcut would reach decode's own namespace and fail.

Needs root (CI runs as root); without it the tests fail, never skip. Ports 24000-24999 and side-channel
ports 25000-25999, away from the session pair in conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from netns import Host, Network, can_make_namespaces

from pdserve import httpclient
from pdserve.commands.verify import wait_for_transfers
from pdserve.config import ProxyConfig
from pdserve.configparts import Routing
from pdserve.doctor.logs import read_lanes, read_log
from pdserve.engines.launcher import EngineGroup
from pdserve.engines.model import resolve_model
from pdserve.engines.placement import InstanceSpec, plan_instances
from pdserve.engines.transfers import transfer_counts
from pdserve.engines.venv import find_engine_python
from pdserve.proxy.serving.thread import ProxyThread
from pdserve.topology import RoleSpec, Topology

pytestmark = pytest.mark.vllm

PROXY_PORT = 24000
MAX_TOKENS = 16


@dataclass(frozen=True)
class Across:
    """The running system: which namespace each instance is in, and how to reach them."""

    network: Network
    prefill: InstanceSpec
    decode: InstanceSpec
    group: EngineGroup
    proxy_url: str
    model: str

    def host(self, spec: InstanceSpec) -> Host:
        return self.network.hosts[spec.role]


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    reason = can_make_namespaces()
    if reason:
        pytest.fail(f"this test builds network namespaces: {reason}")
    with Network(["prefill", "decode"]) as net:
        yield net


@pytest.fixture(scope="module")
def across(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Across]:
    engine_python = find_engine_python(None)
    model = resolve_model("tiny", engine_python)  # the embedded tiny model
    hosts = network.hosts
    topology = Topology(
        prefill=RoleSpec(hosts=(hosts["prefill"].address,)),
        decode=RoleSpec(hosts=(hosts["decode"].address,)),
        first_port=24100,
        first_side_channel_port=25100,
        vllm_args=("--dtype", "float32"),  # as Stack runs the embedded model: one dtype, equal text
    )
    planned = plan_instances(
        topology,
        model.path,
        model.served_model_name,
        sorted(os.sched_getaffinity(0)),
        default_max_model_len=2048,
    )
    # Into its namespace. UCX_TLS=tcp: namespaces share one kernel, so UCX counts the two instances as
    # one node and reads the KV by cross-memory attach (cma/memory, seen here), past any network; hosts
    # of their own would take a network lane. UCX_PROTO_INFO makes UCX log the lanes it reads over.
    ucx_env = (("UCX_TLS", "tcp"), ("UCX_PROTO_INFO", "y"))
    prefill, decode = (
        dataclasses.replace(s, command_prefix=hosts[s.role].exec_prefix, env=(*s.env, *ucx_env))
        for s in planned
    )
    run_dir = tmp_path_factory.mktemp("netns-run")
    group = EngineGroup(
        (prefill, decode), engine_python, run_dir, 300.0, lambda m: print(f"[netns] {m}", flush=True)
    )
    config = ProxyConfig.pd(
        (prefill.url,),
        (decode.url,),
        host=network.gateway,  # on the bridge: reachable from decode's namespace, for doctor
        port=PROXY_PORT,
        routing=Routing(tokenizer=model.path, prefix_block_size=128),
    )
    with group:
        proxy = ProxyThread(config)
        proxy.start()
        try:
            yield Across(network, prefill, decode, group, proxy.url, model.served_model_name or model.path)
        finally:
            proxy.stop()


def _complete(url: str, model: str, prompt: str, **extra: object) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    response = httpclient.post_json(f"{url}/v1/completions", body, 120)
    assert response.status == 200, response.body[:500]
    return str(response.json()["choices"][0]["text"])


def _established(host: Host) -> list[tuple[str, str]]:
    """(local, peer) of every established TCP connection in ``host``'s namespace."""
    out = subprocess.run(
        [*host.exec_prefix, "ss", "-tnH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    return [(cols[-2], cols[-1]) for cols in (line.split() for line in out.splitlines()) if len(cols) >= 4]


def _connects_from(host: Host, address: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(({address!r}, {port}), timeout=3).close()"
    return (
        subprocess.run([*host.exec_prefix, sys.executable, "-c", probe], capture_output=True).returncode == 0
    )


def test_each_instance_has_only_its_namespace_address_besides_loopback(across: Across) -> None:
    for spec in (across.prefill, across.decode):
        assert sorted(across.host(spec).addresses()) == sorted(["127.0.0.1", spec.host])
        assert spec.url == f"http://{across.host(spec).address}:{spec.port}"
    # The control: from decode's namespace prefill's side channel answers at prefill's address only.
    # Had prefill advertised 127.0.0.1 (vLLM's default is localhost), decode would have dialled itself.
    decode_ns, port = across.host(across.decode), across.prefill.side_channel_port
    assert _connects_from(decode_ns, across.prefill.host, port)
    assert not _connects_from(decode_ns, "127.0.0.1", port)


def test_kv_crosses_the_bridge_and_the_answer_equals_decode_alone(across: Across) -> None:
    prompt = f"netns {uuid.uuid4().hex[:6]}: the lighthouse keeper climbed the stairs and"
    before = transfer_counts([across.decode.url])
    text = _complete(across.proxy_url, across.model, prompt)
    delta = wait_for_transfers([across.decode.url], before, expected=1)
    assert (delta.successful, delta.failed) == (1, 0), delta
    assert delta.bytes > 0
    # The oracle: decode computing the prompt itself. Its own cache_salt keeps it from reusing the
    # blocks it just pulled, so wrong KV could not make the two agree.
    assert text and text == _complete(across.decode.url, across.model, prompt, cache_salt=uuid.uuid4().hex)

    # What decode dialled: the side channel prefill advertised, at prefill's namespace address.
    [trace] = [
        t
        for t in httpclient.get(f"{across.proxy_url}/requests", 10).json()["requests"]
        if t.get("kv_transfer_params")
    ][-1:]
    params = trace["kv_transfer_params"]
    assert (params["remote_host"], params["remote_port"]) == (
        across.prefill.host,
        across.prefill.side_channel_port,
    )

    # The bytes: UCX keeps its TCP connection between the two namespace addresses, and reads over the
    # namespace's veth, not lo (decode's log, UCX_PROTO_INFO).
    peers = {peer.rsplit(":", 1)[0] for _local, peer in _established(across.host(across.prefill))}
    assert across.decode.host in peers, peers
    lanes = read_lanes(read_log(across.group.log_path(across.decode)))
    assert lanes, "decode's log shows no UCX read lanes (UCX_PROTO_INFO=y)"
    assert {lane.lane for lane in lanes} == {f"tcp/{across.host(across.decode).link}"}, lanes


def test_doctor_run_in_decodes_namespace_tests_decodes_own_route(across: Across) -> None:
    decode_ns = across.host(across.decode)
    args = ["doctor", across.proxy_url, "--logs", str(across.group.log_path(across.decode).parent)]
    args += ["--prompt-tokens", "600", "--json"]
    done = subprocess.run(
        [
            *decode_ns.exec_prefix,
            sys.executable,
            "-c",
            "import sys; from pdserve import cli; sys.exit(cli.main(sys.argv[1:]))",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    [pair] = report["pairs"]
    checks = {c["status"]: [] for c in pair["checks"]}
    for c in pair["checks"]:
        checks[c["status"]].append(c["what"])
    assert checks.get("fail", []) == [], (done.returncode, checks, done.stderr[-2000:])
    side = f"{across.prefill.host}:{across.prefill.side_channel_port} accepts TCP from decode's host"
    assert any(side in what and across.decode.host in what for what in checks["pass"]), checks
    assert not any("within one kernel" in what for what in checks.get("warn", [])), checks  # tcp, not cma
    assert done.returncode in (0, 3), done.stderr[-2000:]  # healthy, or healthy but the CPU link does not pay
