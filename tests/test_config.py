"""Configs fail at construction with a message naming the field, and stay frozen."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import replace

import pytest

from pdserve.config import ProxyConfig, ProxySettings, Timeouts, lease_warnings, normalize_url
from pdserve.configparts import AdmissionLimits, ApiKeys, HealthChecks, PoolSpec, Retries, Routing
from pdserve.errors import ConfigError
from pdserve.topology import RoleSpec, Topology
from pdserve.topologyfile import topology_from_mapping
from pdserve.tppairing import KVShape

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
    config = ProxyConfig.pd(("127.0.0.1:8100",), ("http://127.0.0.1:8101/", "127.0.0.1:8102"))
    assert config.pool("prefill").urls == ("http://127.0.0.1:8100",)
    assert config.pool("decode").urls == ("http://127.0.0.1:8101", "http://127.0.0.1:8102")


@pytest.mark.parametrize(
    ("prefill", "decode", "flag"), [((), ("h:1",), "--prefill"), (("h:1",), (), "--decode")]
)
def test_proxy_needs_both_roles(prefill: tuple[str, ...], decode: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ProxyConfig.pd(prefill, decode)


def test_proxy_config_rejects_a_bad_instance_url() -> None:
    with pytest.raises(ConfigError, match="http://h:1/v1"):
        ProxyConfig.pd(("http://h:1/v1",), ("h:2",))


@pytest.mark.parametrize(
    ("field", "value"),
    [("port", 70000), ("port", -1), ("max_connections_per_upstream", 0), ("kv_lease_s", 0), ("workers", 65)],
)
def test_proxy_config_names_the_bad_field(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=rf"proxy\.{field}"):
        ProxyConfig.pd(("h:1",), ("h:2",), **{field: value})


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: AdmissionLimits(max_body_bytes=0), r"proxy\.admission\.max_body_bytes"),
        (lambda: AdmissionLimits(max_concurrent=0), r"proxy\.admission\.max_concurrent"),
        (lambda: PoolSpec("decode", max_attempts=0), r"proxy\.decode\.max_attempts"),
        (lambda: Retries(first_backoff_s=-1), r"proxy\.retries\.first_backoff_s"),
        (lambda: HealthChecks(interval_s=0), r"proxy\.health\.interval_s"),
        (lambda: HealthChecks(breaker_cooldown_s=-1), r"proxy\.health\.breaker_cooldown_s"),
        (lambda: Routing(prefix_block_size=0), r"proxy\.routing\.prefix_block_size"),
        (lambda: Routing(skip_prefill_below_tokens=-1), r"proxy\.routing\.skip_prefill_below_tokens"),
    ],
)
def test_each_part_of_the_proxy_config_names_its_bad_field(make: Callable[[], object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make()


def test_settings_fronting_instances_keep_every_setting() -> None:
    settings = ProxySettings(
        timeouts=Timeouts(connect=1),
        pools=(PoolSpec("prefill", policy="prefix_aware"), PoolSpec("decode", max_attempts=3)),
        routing=Routing(tokenizer="/models/m"),
        retries=Retries(first_backoff_s=0.5),
        admission=AdmissionLimits(max_queued=1),
        health=HealthChecks(interval_s=9),
        api_keys=ApiKeys(upstream="u"),
        max_connections_per_upstream=7,
        kv_lease_s=12,
        workers=2,
        otlp_traces_endpoint="http://collector:4318/v1/traces",
        first_token_at_once=True,
    )
    config = settings.fronting({"prefill": ("h:1",), "decode": ("h:2",)}, host="0.0.0.0", port=9000)
    for f in dataclasses.fields(ProxySettings):
        # The pools gain their instances; every other setting is carried as it is.
        kept = (
            getattr(config, f.name) if f.name != "pools" else tuple(replace(p, urls=()) for p in config.pools)
        )
        assert kept == getattr(settings, f.name), f.name
        assert getattr(settings, f.name) != f.default, (
            f"{f.name} left at its default: the check proves nothing"
        )
    assert (config.host, config.port, config.pool("prefill").urls) == ("0.0.0.0", 9000, ("http://h:1",))
    assert (config.pool("prefill").policy, config.pool("decode").max_attempts) == ("prefix_aware", 3)


def test_each_role_is_a_pool_and_an_elastic_pool_takes_either_part() -> None:
    pd = ProxyConfig.pd(("h:1",), ("h:2",))
    assert pd.roles() == ("prefill", "decode") and pd.can_split
    colocated = ProxyConfig(pools=(PoolSpec("decode", ("h:2",)),))  # no prefill pool: nothing is split
    assert not colocated.can_split and colocated.pool("prefill").urls == ()
    elastic = ProxyConfig(pools=(PoolSpec("elastic", ("h:1", "h:2"), max_attempts=3),))
    assert elastic.pool("prefill") == elastic.pool("decode") == elastic.pool("elastic")
    assert elastic.pool("prefill").max_attempts == 3
    with pytest.raises(ConfigError, match="give them as --instance only"):
        ProxyConfig(pools=(PoolSpec("prefill", ("h:1",)), PoolSpec("elastic", ("h:2",))))
    with pytest.raises(ConfigError, match="2 decode pools"):
        ProxyConfig(pools=(PoolSpec("decode", ("h:1",)), PoolSpec("decode", ("h:2",))))
    with pytest.raises(ConfigError, match="role must be one of prefill, decode, elastic"):
        PoolSpec("both")  # type: ignore[arg-type]


def test_proxy_config_is_frozen() -> None:
    config = ProxyConfig.pd(("h:1",), ("h:2",))
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


def test_topology_refuses_tensor_parallel_sizes_vllm_cannot_pair() -> None:
    with pytest.raises(
        ConfigError, match=r"topology.prefill.args / topology.decode.args: prefill TP2 and decode TP3"
    ):
        Topology(prefill=RoleSpec(args=("--tensor-parallel-size", "2")), decode=RoleSpec(args=("-tp", "3")))


def test_topology_accepts_a_heterogeneous_pair_vllm_supports_and_says_how_it_maps() -> None:
    topology = Topology(
        vllm_args=("--tensor-parallel-size", "2"), decode=RoleSpec(args=("--tensor-parallel-size", "4"))
    )
    pairing = topology.tp_pairing(KVShape(num_kv_heads=8))
    assert pairing is not None and pairing.tp_ratio == 2
    assert "each reading 2 of its 4 KV heads" in pairing.describe()


def test_once_the_models_kv_heads_are_known_a_replicated_prefill_into_a_smaller_decode_is_refused() -> None:
    topology = Topology(prefill=RoleSpec(args=("--tensor-parallel-size", "4")))  # any model might do
    assert topology.tp_pairing() is not None
    with pytest.raises(ConfigError, match="model's 2 KV heads"):
        topology.tp_pairing(KVShape(num_kv_heads=2))


def test_topology_refuses_block_sizes_vllm_cannot_pair() -> None:
    with pytest.raises(ConfigError, match="decode --block-size 16 is not a multiple of prefill's 32"):
        Topology(prefill=RoleSpec(args=("--block-size", "32")), decode=RoleSpec(args=("--block-size=16",)))


def test_an_elastic_pool_shares_one_tp_and_has_no_pair_to_check() -> None:
    pool = Topology(elastic=RoleSpec(count=2, args=("--tensor-parallel-size", "2")))
    assert pool.tp_pairing() is None


def test_topology_counts_its_instances() -> None:
    assert Topology(prefill=RoleSpec(count=2), decode=RoleSpec(count=3)).num_instances == 5


@pytest.mark.parametrize(("num_prefill", "num_decode"), [(0, 1), (1, 0), (-1, 2)])
def test_topology_needs_an_instance_of_each_role(num_prefill: int, num_decode: int) -> None:
    with pytest.raises(ConfigError, match=">= 1 prefill and >= 1 decode"):
        Topology(prefill=RoleSpec(count=num_prefill), decode=RoleSpec(count=num_decode))


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
        Topology(first_port=65535, decode=RoleSpec(count=2))


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


# --- instance addresses (prefill.hosts / decode.hosts) -------------------------------------------------


def test_each_instance_can_have_its_own_address_given_in_the_topology_file() -> None:
    topology = topology_from_mapping(
        {"prefill": {"count": 2, "hosts": ["10.0.0.2", "10.0.0.3"]}, "decode": {"hosts": ["gpu-b.lan"]}}
    )
    assert topology.instance_hosts == ("10.0.0.2", "10.0.0.3", "gpu-b.lan")


@pytest.mark.parametrize(
    ("hosts", "match"),
    [
        ({"prefill": ("10.0.0.2", "10.0.0.3")}, r"prefill\.hosts names 2 address\(es\) for 1 prefill"),
        ({"prefill": ("0.0.0.0",), "decode": ("10.0.0.3",)}, "not an address a peer can dial"),
        ({"prefill": ("10.0.0.2",), "decode": ("http://10.0.0.3:80",)}, "'http://10.0.0.3:80'"),
        # decode falls back to host 127.0.0.1: it could not reach prefill, nor prefill's side channel it
        ({"prefill": ("10.0.0.2",)}, r"mixes loopback \(127\.0\.0\.1\) and other instance addresses"),
        ({"prefill": ("localhost",), "decode": ("10.0.0.3",)}, "mixes loopback"),
    ],
)
def test_an_address_a_peer_cannot_dial_is_refused(hosts: dict[str, tuple[str, ...]], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Topology(**{role: RoleSpec(hosts=addresses) for role, addresses in hosts.items()})  # type: ignore[arg-type]


def test_a_wildcard_host_is_reached_and_advertised_as_loopback() -> None:
    # vLLM would advertise 0.0.0.0 verbatim as prefill's side channel, and decode would dial itself.
    assert Topology(host="0.0.0.0").instance_hosts == ("127.0.0.1", "127.0.0.1")


def test_start_up_warns_when_decode_attempts_can_outlast_half_the_kv_lease() -> None:
    # 3 attempts x 5 s connect + two backoffs (0.05 s, 0.1 s) reach half of a 30 s lease: a retried
    # handoff would rarely still be held.
    pools = (PoolSpec("prefill", ("http://p:1",)), PoolSpec("decode", ("http://d:1",), max_attempts=3))
    config = ProxyConfig(pools=pools, kv_lease_s=30)
    [warning] = lease_warnings(config)
    assert "3 decode attempts x connect timeout 5 s" in warning and "--kv-lease" in warning
    assert lease_warnings(ProxyConfig.pd(("http://p:1",), ("http://d:1",))) == []  # the defaults fit


def test_start_up_warns_of_a_kv_lease_a_stalled_decode_outlasts() -> None:
    config = ProxyConfig.pd(("http://p:1",), ("http://d:1",), kv_lease_s=8, timeouts=Timeouts(connect=1))
    [warning] = lease_warnings(config)
    assert warning.startswith("KV lease 8 s:") and "prefills again" in warning


def test_retries_back_off_doubling_to_at_most_a_second() -> None:
    retries = Retries(first_backoff_s=0.3)
    assert [retries.backoff(n) for n in (1, 2, 3, 4)] == [0.3, 0.6, 1.0, 1.0]


# --- an elastic pool ----------------------------------------------------------------------------------


def test_an_elastic_topology_is_one_role_of_n_instances_instead_of_prefill_and_decode() -> None:
    topology = Topology(elastic=RoleSpec(count=3, args=("--max-num-seqs", "8")))
    assert topology.is_elastic and not Topology().is_elastic
    assert topology.roles() == (("elastic", RoleSpec(count=3, args=("--max-num-seqs", "8"))),)
    assert topology.num_instances == 3
    assert topology.instance_hosts == ("127.0.0.1",) * 3
    assert topology.role("elastic").count == 3 and Topology().role("elastic") == RoleSpec()


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"elastic": RoleSpec(count=0)}, r"topology.elastic needs >= 1 instance, got 0"),
        ({"elastic": RoleSpec(count=3), "prefill": RoleSpec(count=2)}, "elastic replaces prefill and decode"),
        (
            {"elastic": RoleSpec(count=3), "decode": RoleSpec(args=("--x",))},
            "set elastic, or prefill and decode",
        ),
        ({"elastic": RoleSpec(count=2), "kv_both": True}, "kv_both is for a prefill/decode topology"),
        ({"elastic": RoleSpec(count=2, hosts=("10.0.0.2",))}, "elastic"),  # one address for two instances
        (
            {"elastic": RoleSpec(resources=(("gpu_node", 1.0),))},
            r"topology.elastic.resources .* need topology.ray",
        ),
    ],
)
def test_a_wrong_elastic_topology_is_refused_naming_what_to_change(
    values: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Topology(**values)  # type: ignore[arg-type]


def test_an_elastic_pool_reads_a_ports_range_of_its_own_size() -> None:
    with pytest.raises(ConfigError, match="ports overlap"):
        Topology(elastic=RoleSpec(count=3), first_port=5598, first_side_channel_port=5600)
    Topology(elastic=RoleSpec(count=3), first_port=5597, first_side_channel_port=5600)
