"""Topology files: the accepted shape, unknown keys and unreadable files refused with what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.errors import ConfigError
from pdserve.topology import RoleSpec, Topology
from pdserve.topologyfile import load_topology, topology_from_mapping


def test_topology_mapping_takes_roles_as_count_and_args() -> None:
    topology = topology_from_mapping(
        {
            "model": "/models/tiny",
            "prefill": {"count": 2, "args": ["--max-num-seqs", 64]},
            "decode": {"count": 3},
            "proxy_port": 9000,
            "vllm_args": ["--enforce-eager"],
        }
    )
    assert topology.model == "/models/tiny"
    assert (topology.prefill.count, topology.decode.count) == (2, 3)
    assert topology.prefill.args == ("--max-num-seqs", "64")
    assert topology.decode.args == ()
    assert topology.vllm_args == ("--enforce-eager",)
    assert topology.proxy_port == 9000


def test_topology_mapping_keeps_the_base_for_missing_keys() -> None:
    base = Topology(first_port=9100, decode=RoleSpec(count=2))
    topology = topology_from_mapping({"prefill": {"count": 3}}, base)
    assert (topology.prefill.count, topology.decode.count, topology.first_port) == (3, 2, 9100)


def test_unknown_topology_key_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError, match="'replicas'") as caught:
        topology_from_mapping({"replicas": 2})
    message = str(caught.value)
    for key in ("prefill", "decode", "model", "proxy_port", "vllm_args"):
        assert key in message
    assert "num_prefill" not in message  # written as prefill: {count: N}


@pytest.mark.parametrize("value", [2, {"count": 2, "gpus": 1}, ["count"]])
def test_role_entry_must_be_count_and_args(value: object) -> None:
    with pytest.raises(ConfigError, match=r"topology\.prefill must be a mapping"):
        topology_from_mapping({"prefill": value})


def test_args_must_be_a_list() -> None:
    with pytest.raises(ConfigError, match=r"topology\.vllm_args must be a list"):
        topology_from_mapping({"vllm_args": "--enforce-eager"})


def test_topology_mapping_values_are_validated_too() -> None:
    with pytest.raises(ConfigError):
        topology_from_mapping({"decode": {"count": 0}})
    with pytest.raises(ConfigError, match="invalid topology"):
        topology_from_mapping({"decode": {"count": "two"}})


def test_load_topology_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text("prefill:\n  count: 2\n  args: [--max-num-seqs, '64']\ndecode: {count: 1}\n")
    topology = load_topology(path)
    assert (topology.prefill.count, topology.decode.count) == (2, 1)
    assert topology.prefill.args == ("--max-num-seqs", "64")


def test_empty_topology_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_topology(path) == Topology()


def test_unknown_key_in_topology_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text("prefil: {count: 2}\n")
    with pytest.raises(ConfigError, match="unknown topology key 'prefil'; valid keys:"):
        load_topology(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [("- prefill\n- decode\n", "mapping at the top level"), ("prefill: [unclosed\n", "cannot read")],
)
def test_unreadable_topology_file_is_an_error(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_topology(path)


def test_missing_topology_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read topology file"):
        load_topology(tmp_path / "absent.yaml")


def test_a_role_key_may_also_be_written_flat() -> None:
    # docs/deploying.md shows prefill_hosts: [...] beside prefill: {hosts: [...]}; both mean one RoleSpec.
    topology = topology_from_mapping(
        {"prefill": {"count": 2}, "prefill_hosts": ["10.0.0.2", "10.0.0.3"], "decode_hosts": ["10.0.0.4"]}
    )
    assert topology.prefill == RoleSpec(count=2, hosts=("10.0.0.2", "10.0.0.3"))
    assert topology.decode.hosts == ("10.0.0.4",)


def test_an_elastic_pool_is_written_as_one_role_of_count_args_hosts() -> None:
    topology = topology_from_mapping(
        {"elastic": {"count": 3, "args": ["--max-num-seqs", 8]}, "model": "tiny"}
    )
    assert topology.elastic == RoleSpec(count=3, args=("--max-num-seqs", "8"))
    assert [name for name, _ in topology.roles()] == ["elastic"]
    flat = topology_from_mapping({"num_elastic": 2, "elastic_hosts": ["10.0.0.2", "10.0.0.3"]})
    assert flat.elastic == RoleSpec(count=2, hosts=("10.0.0.2", "10.0.0.3"))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"elastic": 3}, "topology.elastic must be a mapping with 'count'"),
        ({"elastic": {"count": 3, "roles": "any"}}, "topology.elastic must be a mapping with 'count'"),
        ({"elastic": {"count": 3}, "prefill": {"count": 1, "args": ["--x"]}}, "elastic replaces prefill"),
        ({"elastic": {"count": "three"}}, "topology.elastic"),
    ],
)
def test_a_wrong_elastic_entry_is_refused_naming_it(data: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        topology_from_mapping(data)
