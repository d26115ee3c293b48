from __future__ import annotations

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
