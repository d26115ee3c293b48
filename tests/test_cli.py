from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import _topology, build_parser, main


def test_flags_override_the_topology_file(tmp_path: Path) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text("prefill: {count: 2}\ndecode: {count: 3}\nproxy_port: 9000\nvllm_args: ['--a']\n")
    args = build_parser().parse_args(["up", "--config", str(topo), "--decode", "1", "--vllm-arg=--b"])
    topology = _topology(args)
    assert (topology.num_prefill, topology.num_decode, topology.proxy_port) == (2, 1, 9000)
    assert topology.vllm_args == ("--a", "--b")


def test_up_defaults_are_one_prefill_one_decode_on_port_8000() -> None:
    topology = _topology(build_parser().parse_args(["up"]))
    assert (topology.num_prefill, topology.num_decode, topology.proxy_port) == (1, 1, 8000)


def test_bad_topology_is_a_clear_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text("prefil: {count: 2}\n")
    assert main(["up", "--config", str(topo)]) == 2
    err = capsys.readouterr().err
    assert "unknown topology key 'prefil'" in err and "prefill" in err


def test_proxy_requires_both_roles(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["proxy", "--prefill", "http://127.0.0.1:1"])
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
