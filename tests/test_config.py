"""Configs fail at construction with a message naming the field, and stay frozen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.config import (
    ProxyConfig,
    Timeouts,
    Topology,
    load_topology,
    normalize_url,
    topology_from_mapping,
)
from pdserve.errors import ConfigError

# --- URLs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("127.0.0.1:8100", "http://127.0.0.1:8100"),
        ("http://127.0.0.1:8100/", "http://127.0.0.1:8100"),
        ("  http://host:8100  ", "http://host:8100"),
        ("https://host", "https://host"),
        ("localhost:8000", "http://localhost:8000"),
    ],
)
def test_instance_urls_are_normalised(given: str, expected: str) -> None:
    assert normalize_url(given) == expected


@pytest.mark.parametrize(
    "given",
    [
        "",
        "ftp://host:21",
        "http://host:8100/v1",
        "http://:8100",
        "http://",
        "http://host:port",
        "http://host:99999",
        "http://host:8100?x=1",
    ],
)
def test_what_is_not_an_instance_url_is_refused(given: str) -> None:
    with pytest.raises(ConfigError, match="URL"):
        normalize_url(given)


# --- ProxyConfig -------------------------------------------------------------------------------------


def test_proxy_config_normalises_its_urls() -> None:
    config = ProxyConfig(("127.0.0.1:8100",), ("http://127.0.0.1:8101/", "127.0.0.1:8102"))
    assert config.prefill_urls == ("http://127.0.0.1:8100",)
    assert config.decode_urls == ("http://127.0.0.1:8101", "http://127.0.0.1:8102")


@pytest.mark.parametrize(
    ("prefill", "decode", "flag"), [((), ("h:1",), "--prefill"), (("h:1",), (), "--decode")]
)
def test_proxy_needs_both_roles(prefill: tuple[str, ...], decode: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ProxyConfig(prefill, decode)


def test_proxy_config_rejects_a_bad_instance_url() -> None:
    with pytest.raises(ConfigError, match="http://h:1/v1"):
        ProxyConfig(("http://h:1/v1",), ("h:2",))


@pytest.mark.parametrize(
    ("field", "value"),
    [("port", 70000), ("port", -1), ("max_body_bytes", 0), ("max_connections_per_upstream", 0)],
)
def test_proxy_config_names_the_bad_field(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=rf"proxy\.{field}"):
        ProxyConfig(("h:1",), ("h:2",), **{field: value})


def test_proxy_config_is_frozen() -> None:
    config = ProxyConfig(("h:1",), ("h:2",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    assert dataclasses.replace(config, port=9000).port == 9000


# --- Timeouts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Timeouts)])
@pytest.mark.parametrize("value", [0, -1.5])
def test_every_timeout_must_be_positive(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"timeouts\.{field} must be > 0"):
        Timeouts(**{field: value})


def test_default_timeouts_are_valid() -> None:
    assert Timeouts().idle > 0


# --- Topology ----------------------------------------------------------------------------------------


def test_topology_counts_its_instances() -> None:
    assert Topology(num_prefill=2, num_decode=3).num_instances == 5


@pytest.mark.parametrize(("num_prefill", "num_decode"), [(0, 1), (1, 0), (-1, 2)])
def test_topology_needs_an_instance_of_each_role(num_prefill: int, num_decode: int) -> None:
    with pytest.raises(ConfigError, match=">= 1 prefill and >= 1 decode"):
        Topology(num_prefill=num_prefill, num_decode=num_decode)


@pytest.mark.parametrize(
    "ports",
    [
        {"first_port": 5600, "first_side_channel_port": 5601},  # HTTP 5600-5601 meets side channel 5601
        {"proxy_port": 8101},  # inside the HTTP range 8100-8101
        {"proxy_port": 5601},  # inside the side-channel range 5600-5601
    ],
)
def test_topology_ports_must_not_overlap(ports: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="overlap"):
        Topology(**ports)


def test_topology_ports_just_apart_are_fine() -> None:
    topology = Topology(first_port=5600, first_side_channel_port=5602, proxy_port=5604)
    assert topology.num_instances == 2


def test_topology_ports_must_stay_below_65536() -> None:
    with pytest.raises(ConfigError, match="65535"):
        Topology(first_port=65535, num_decode=2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device", "tpu"),
        ("proxy_port", 70000),
        ("kv_cache_gib", 0),
        ("startup_timeout", 0),
        ("max_model_len", 0),
        ("on_instance_exit", "ignore"),
    ],
)
def test_topology_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        Topology(**{field: value})  # type: ignore[arg-type]


# --- Topology from YAML ------------------------------------------------------------------------------


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
    assert (topology.num_prefill, topology.num_decode) == (2, 3)
    assert topology.prefill_args == ("--max-num-seqs", "64")
    assert topology.decode_args == ()
    assert topology.vllm_args == ("--enforce-eager",)
    assert topology.proxy_port == 9000


def test_topology_mapping_keeps_the_base_for_missing_keys() -> None:
    base = Topology(first_port=9100, num_decode=2)
    topology = topology_from_mapping({"prefill": {"count": 3}}, base)
    assert (topology.num_prefill, topology.num_decode, topology.first_port) == (3, 2, 9100)


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
    assert (topology.num_prefill, topology.num_decode) == (2, 1)
    assert topology.prefill_args == ("--max-num-seqs", "64")


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


# --- instance addresses (prefill_hosts / decode_hosts) -------------------------------------------------


def test_each_instance_can_have_its_own_address_given_in_the_topology_file() -> None:
    topology = topology_from_mapping(
        {"prefill": {"count": 2, "hosts": ["10.0.0.2", "10.0.0.3"]}, "decode": {"hosts": ["gpu-b.lan"]}}
    )
    assert topology.instance_hosts == ("10.0.0.2", "10.0.0.3", "gpu-b.lan")


@pytest.mark.parametrize(
    ("hosts", "match"),
    [
        ({"prefill_hosts": ("10.0.0.2", "10.0.0.3")}, r"prefill_hosts names 2 address\(es\) for 1 prefill"),
        ({"prefill_hosts": ("0.0.0.0",), "decode_hosts": ("10.0.0.3",)}, "not an address a peer can dial"),
        ({"prefill_hosts": ("10.0.0.2",), "decode_hosts": ("http://10.0.0.3:80",)}, "'http://10.0.0.3:80'"),
        # decode falls back to host 127.0.0.1: it could not reach prefill, nor prefill's side channel it
        ({"prefill_hosts": ("10.0.0.2",)}, r"mixes loopback \(127\.0\.0\.1\) and other instance addresses"),
        ({"prefill_hosts": ("localhost",), "decode_hosts": ("10.0.0.3",)}, "mixes loopback"),
    ],
)
def test_an_address_a_peer_cannot_dial_is_refused(hosts: dict[str, tuple[str, ...]], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Topology(**hosts)  # type: ignore[arg-type]


def test_a_wildcard_host_is_reached_and_advertised_as_loopback() -> None:
    # vLLM would advertise 0.0.0.0 verbatim as prefill's side channel, and decode would dial itself.
    assert Topology(host="0.0.0.0").instance_hosts == ("127.0.0.1", "127.0.0.1")
