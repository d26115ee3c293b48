"""plan_instances: pure, so every case is a Topology in and InstanceSpecs out."""

from __future__ import annotations

import json

import pytest

from pdserve.config import Topology
from pdserve.engines.plan import InstanceSpec, cpu_list, plan_instances, plan_sim_instances
from pdserve.errors import ConfigError


def arg_value(spec: InstanceSpec, flag: str) -> str:
    return spec.args[spec.args.index(flag) + 1]


def binds(specs: tuple[InstanceSpec, ...]) -> list[str]:
    return [dict(s.env)["VLLM_CPU_OMP_THREADS_BIND"] for s in specs]


def test_prefill_instances_come_first_with_consecutive_ports() -> None:
    topology = Topology(num_prefill=2, num_decode=1, first_port=9200, first_side_channel_port=5800)
    specs = plan_instances(topology, "/models/m", None, [0, 1, 2])
    assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0"]
    assert [s.port for s in specs] == [9200, 9201, 9202]
    assert [s.side_channel_port for s in specs] == [5800, 5801, 5802]
    assert [s.url for s in specs] == [
        "http://127.0.0.1:9200",
        "http://127.0.0.1:9201",
        "http://127.0.0.1:9202",
    ]
    for spec in specs:
        assert arg_value(spec, "--port") == str(spec.port)
        assert arg_value(spec, "--host") == "127.0.0.1"
        env = dict(spec.env)
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(spec.side_channel_port)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert env["HF_HUB_OFFLINE"] == env["PYTHONUNBUFFERED"] == env["VLLM_NO_USAGE_STATS"] == "1"


def test_kv_transfer_config_gives_prefill_producer_and_decode_consumer() -> None:
    prefill, decode = plan_instances(Topology(), "/models/m", None, [0, 1])
    assert json.loads(arg_value(prefill, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
    }
    assert json.loads(arg_value(decode, "--kv-transfer-config"))["kv_role"] == "kv_consumer"


def test_kv_both_topology_starts_every_instance_able_to_take_either_role_or_a_whole_request() -> None:
    specs = plan_instances(Topology(kv_both=True), "/models/m", None, [0, 1])
    assert [json.loads(arg_value(s, "--kv-transfer-config"))["kv_role"] for s in specs] == ["kv_both"] * 2
    assert [s.role for s in specs] == ["prefill", "decode"]  # their place in the PD topology is kept
    sims = plan_sim_instances(Topology(engine="sim", kv_both=True))
    assert [arg_value(s, "--both") for s in sims] == ["1", "1"]
    assert [arg_value(s, "--prefill") for s in sims] == ["0", "0"]


def test_args_order_lets_user_and_role_args_override_the_defaults() -> None:
    topology = Topology(
        kv_cache_gib=3,
        vllm_args=("--dtype", "float32"),
        prefill_args=("--max-num-seqs", "8"),
        decode_args=("--max-num-seqs", "64"),
    )
    prefill, decode = plan_instances(topology, "/m", "pdserve-tiny", [0, 1], default_max_model_len=2048)
    assert prefill.args == (
        "--model", "/m",
        "--served-model-name", "pdserve-tiny",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--max-model-len", "2048",
        "--enforce-eager",
        "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}',
        "--dtype", "float32",
        "--max-num-seqs", "8",
    )  # fmt: skip
    assert decode.args[-4:] == ("--dtype", "float32", "--max-num-seqs", "64")
    assert dict(prefill.env)["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert dict(prefill.env)["VLLM_TARGET_DEVICE"] == "cpu"


def test_max_model_len_comes_from_topology_then_default_then_the_model() -> None:
    (spec, _) = plan_instances(Topology(max_model_len=512), "/m", None, [0, 1], default_max_model_len=2048)
    assert arg_value(spec, "--max-model-len") == "512"
    (spec, _) = plan_instances(Topology(), "/m", "x", [0, 1])
    assert "--max-model-len" not in spec.args and arg_value(spec, "--served-model-name") == "x"


def test_1p1d_on_two_cores_gets_one_core_each() -> None:
    assert binds(plan_instances(Topology(), "/m", None, [0, 1])) == ["0", "1"]


def test_2p2d_on_four_cores_gets_one_core_each_and_1p1d_two_each() -> None:
    assert binds(plan_instances(Topology(num_prefill=2, num_decode=2), "/m", None, range(4))) == [
        "0",
        "1",
        "2",
        "3",
    ]
    assert binds(plan_instances(Topology(), "/m", None, [3, 2, 1, 0])) == ["0-1", "2-3"]


def test_spare_cores_go_to_prefill_first() -> None:
    assert binds(plan_instances(Topology(), "/m", None, [0, 1, 2])) == ["0-1", "2"]
    assert binds(plan_instances(Topology(), "/m", None, [0, 2, 4, 5, 6])) == ["0,2,4", "5-6"]


def test_more_instances_than_cores_falls_back_to_no_binding_and_one_thread() -> None:
    specs = plan_instances(Topology(num_prefill=2, num_decode=2), "/m", None, [0, 1])
    for spec in specs:
        env = dict(spec.env)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert env["OMP_NUM_THREADS"] == "1"


def test_no_cores_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no CPU cores"):
        plan_instances(Topology(), "/m", None, [])


def test_cuda_gives_each_instance_its_own_gpus_and_no_cpu_settings() -> None:
    topology = Topology(num_prefill=1, num_decode=2, device="cuda", gpus_per_instance=2)
    specs = plan_instances(topology, "/m", None, [0, 1], gpu_ids=[0, 1, 2, 3, 4, 5, 6])
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3", "4,5"]
    for spec in specs:
        assert json.loads(arg_value(spec, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
        assert "--enforce-eager" not in spec.args
        assert not any(key.startswith(("VLLM_CPU", "OMP_", "VLLM_TARGET")) for key, _ in spec.env)


def test_cuda_with_too_few_gpus_is_a_config_error() -> None:
    topology = Topology(num_prefill=2, num_decode=2, device="cuda", gpus_per_instance=2)
    with pytest.raises(ConfigError, match=r"needs 8 GPUs .* but 7 are available"):
        plan_instances(topology, "/m", None, [0, 1], gpu_ids=range(7))
    with pytest.raises(ConfigError, match="needs 2 GPUs"):
        plan_instances(Topology(device="cuda"), "/m", None, [0, 1])


@pytest.mark.parametrize("arg", ["--port", "--port=9000", "--host", "--model", "--kv-transfer-config"])
def test_user_args_must_not_override_what_the_plan_owns(arg: str) -> None:
    with pytest.raises(ConfigError, match=f"topology.decode_args must not set {arg.split('=')[0]}"):
        plan_instances(Topology(decode_args=(arg, "x")), "/m", None, [0, 1])


def test_cpu_list_compresses_runs() -> None:
    assert cpu_list([0]) == "0"
    assert cpu_list([3, 0, 1, 2]) == "0-3"
    assert cpu_list([0, 1, 4, 6, 7]) == "0-1,4,6-7"


def test_kv_lease_reaches_both_roles_as_vllms_kv_lease_duration() -> None:
    topology = Topology(num_prefill=1, num_decode=1, kv_lease_s=12)
    for spec in plan_instances(topology, "/m", None, [0, 1]):
        config = json.loads(arg_value(spec, "--kv-transfer-config"))
        assert config["kv_connector_extra_config"] == {"kv_lease_duration": 12}


def test_a_lease_too_short_for_vllms_heartbeat_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_lease_s must be >= 6"):
        Topology(kv_lease_s=5)


def test_tracing_makes_every_instance_export_its_spans_over_otlp_http() -> None:
    topology = Topology(otlp_traces_endpoint="http://collector:4318/v1/traces")
    for spec in plan_instances(topology, "/m", None, [0, 1]):
        assert spec.args[spec.args.index("--otlp-traces-endpoint") + 1] == "http://collector:4318/v1/traces"
        assert ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf") in spec.env
