"""plan_instances: pure, so every case is a Topology in and InstanceSpecs out."""

from __future__ import annotations

import json

import pytest

from pdserve.engines.placement import (
    InstanceSpec,
    cpu_list,
    gpu_memory_share,
    plan_instances,
    plan_sim_instances,
    visible_gpus,
)
from pdserve.errors import ConfigError
from pdserve.topology import RoleSpec, Topology
from pdserve.topologyfile import topology_from_mapping


def arg_value(spec: InstanceSpec, flag: str) -> str:
    return spec.args[spec.args.index(flag) + 1]


def binds(specs: tuple[InstanceSpec, ...]) -> list[str]:
    return [dict(s.env)["VLLM_CPU_OMP_THREADS_BIND"] for s in specs]


def test_prefill_instances_come_first_with_consecutive_ports() -> None:
    topology = Topology(
        prefill=RoleSpec(count=2), decode=RoleSpec(count=1), first_port=9200, first_side_channel_port=5800
    )
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
    # Not vLLM's kv_both, deprecated for NixlConnector: the per-request params decide, as on an elastic pool.
    assert [json.loads(arg_value(s, "--kv-transfer-config"))["kv_role"] for s in specs] == ["kv_consumer"] * 2
    assert [s.role for s in specs] == ["prefill", "decode"]  # their place in the PD topology is kept
    sims = plan_sim_instances(Topology(engine="sim", kv_both=True))
    assert [arg_value(s, "--both") for s in sims] == ["1", "1"]
    assert [arg_value(s, "--prefill") for s in sims] == ["0", "0"]


def test_args_order_lets_user_and_role_args_override_the_defaults() -> None:
    topology = Topology(
        kv_cache_gib=3,
        vllm_args=("--dtype", "float32"),
        prefill=RoleSpec(args=("--max-num-seqs", "8")),
        decode=RoleSpec(args=("--max-num-seqs", "64")),
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
        "--enable-prompt-tokens-details",
        "--dtype", "float32",
        "--max-num-seqs", "8",
    )  # fmt: skip
    assert decode.args[-4:] == ("--dtype", "float32", "--max-num-seqs", "64")
    assert dict(prefill.env)["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert dict(prefill.env)["VLLM_TARGET_DEVICE"] == "cpu"


def test_every_instance_reports_its_cached_tokens_once_even_when_the_user_asks_too() -> None:
    specs = plan_instances(Topology(), "/m", None, [0, 1])
    sims = plan_sim_instances(Topology(engine="sim"))
    assert all(s.args.count("--enable-prompt-tokens-details") == 1 for s in (*specs, *sims))
    given = Topology(vllm_args=("--enable-prompt-tokens-details",))
    assert all(
        s.args.count("--enable-prompt-tokens-details") == 1 for s in plan_instances(given, "/m", None, [0, 1])
    )


def test_max_model_len_comes_from_topology_then_default_then_the_model() -> None:
    (spec, _) = plan_instances(Topology(max_model_len=512), "/m", None, [0, 1], default_max_model_len=2048)
    assert arg_value(spec, "--max-model-len") == "512"
    (spec, _) = plan_instances(Topology(), "/m", "x", [0, 1])
    assert "--max-model-len" not in spec.args and arg_value(spec, "--served-model-name") == "x"


def test_1p1d_on_two_cores_gets_one_core_each() -> None:
    assert binds(plan_instances(Topology(), "/m", None, [0, 1])) == ["0", "1"]


def test_2p2d_on_four_cores_gets_one_core_each_and_1p1d_two_each() -> None:
    assert binds(
        plan_instances(Topology(prefill=RoleSpec(count=2), decode=RoleSpec(count=2)), "/m", None, range(4))
    ) == [
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
    specs = plan_instances(Topology(prefill=RoleSpec(count=2), decode=RoleSpec(count=2)), "/m", None, [0, 1])
    for spec in specs:
        env = dict(spec.env)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert env["OMP_NUM_THREADS"] == "1"


def test_no_cores_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no CPU cores"):
        plan_instances(Topology(), "/m", None, [])


def test_cuda_gives_each_instance_its_own_gpus_and_no_cpu_settings() -> None:
    topology = Topology(
        prefill=RoleSpec(count=1), decode=RoleSpec(count=2), device="cuda", gpus_per_instance=2
    )
    specs = plan_instances(topology, "/m", None, [0, 1], gpu_ids=[0, 1, 2, 3, 4, 5, 6])
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3", "4,5"]
    for spec in specs:
        assert json.loads(arg_value(spec, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
        assert "--enforce-eager" not in spec.args
        assert not any(key.startswith(("VLLM_CPU", "OMP_", "VLLM_TARGET")) for key, _ in spec.env)


def test_cuda_with_too_few_gpus_is_a_config_error() -> None:
    topology = Topology(
        prefill=RoleSpec(count=2), decode=RoleSpec(count=2), device="cuda", gpus_per_instance=2
    )
    with pytest.raises(ConfigError, match=r"needs 8 GPUs .* but 7 are available"):
        plan_instances(topology, "/m", None, [0, 1], gpu_ids=range(7))
    with pytest.raises(ConfigError, match="no GPU is visible"):
        plan_instances(Topology(device="cuda"), "/m", None, [0, 1])


@pytest.mark.parametrize("arg", ["--port", "--port=9000", "--host", "--model", "--kv-transfer-config"])
def test_user_args_must_not_override_what_the_plan_owns(arg: str) -> None:
    with pytest.raises(ConfigError, match=f"topology.decode.args must not set {arg.split('=')[0]}"):
        plan_instances(Topology(decode=RoleSpec(args=(arg, "x"))), "/m", None, [0, 1])


def test_cpu_list_compresses_runs() -> None:
    assert cpu_list([0]) == "0"
    assert cpu_list([3, 0, 1, 2]) == "0-3"
    assert cpu_list([0, 1, 4, 6, 7]) == "0-1,4,6-7"


def test_kv_lease_reaches_both_roles_as_vllms_kv_lease_duration() -> None:
    topology = Topology(prefill=RoleSpec(count=1), decode=RoleSpec(count=1), kv_lease_s=12)
    for spec in plan_instances(topology, "/m", None, [0, 1]):
        config = json.loads(arg_value(spec, "--kv-transfer-config"))
        assert config["kv_connector_extra_config"] == {"kv_lease_duration": 12}


def test_push_starts_both_roles_with_vllms_push_connector_and_its_watchdog_at_the_lease() -> None:
    topology = Topology(kv_transfer="push", kv_lease_s=12)
    for spec in plan_instances(topology, "/m", None, [0, 1]):
        config = json.loads(arg_value(spec, "--kv-transfer-config"))
        assert config["kv_connector"] == "NixlPushConnector"
        assert config["kv_connector_extra_config"] == {
            "kv_lease_duration": 12,
            "push_registration_timeout": 12,
        }
    pull = plan_instances(Topology(), "/m", None, [0, 1])
    assert all(
        json.loads(arg_value(s, "--kv-transfer-config"))["kv_connector"] == "NixlConnector" for s in pull
    )


def test_push_needs_separate_prefill_and_decode_pools() -> None:
    with pytest.raises(ConfigError, match="push needs separate prefill and decode pools"):
        Topology(kv_transfer="push", kv_both=True)
    with pytest.raises(ConfigError, match="kv_transfer must be 'pull' or 'push'"):
        Topology(kv_transfer="write")  # type: ignore[arg-type]


def test_a_lease_too_short_for_vllms_heartbeat_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_lease_s must be >= 6"):
        Topology(kv_lease_s=5)


def test_tracing_makes_every_instance_export_its_spans_over_otlp_http_under_its_own_name() -> None:
    topology = Topology(decode=RoleSpec(count=2), otlp_traces_endpoint="http://collector:4318/v1/traces")
    specs = plan_instances(topology, "/m", None, [0, 1, 2])
    for spec in specs:
        assert spec.args[spec.args.index("--otlp-traces-endpoint") + 1] == "http://collector:4318/v1/traces"
        assert ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf") in spec.env
    # In a trace viewer each instance is a service of its own, named as its log file is.
    assert [dict(s.env)["OTEL_SERVICE_NAME"] for s in specs] == [
        "vllm-prefill-0",
        "vllm-decode-0",
        "vllm-decode-1",
    ]


# --- GPU placement ------------------------------------------------------------------------------------


def gpus_of(specs: tuple[InstanceSpec, ...]) -> list[str]:
    return [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in specs]


def memory_of(specs: tuple[InstanceSpec, ...]) -> list[str | None]:
    return [
        arg_value(s, "--gpu-memory-utilization") if "--gpu-memory-utilization" in s.args else None
        for s in specs
    ]


def test_1p1d_on_a_one_gpu_host_is_the_single_gpu_demo_both_on_gpu_0_at_045_started_in_turn() -> None:
    specs = plan_instances(Topology(device="cuda"), "/m", None, [0, 1], gpu_ids=["0"])
    assert gpus_of(specs) == ["0", "0"]
    assert memory_of(specs) == ["0.45", "0.45"]
    assert [s.start_stage for s in specs] == [0, 1]  # decode starts once prefill is healthy


def test_with_enough_gpus_the_default_gives_each_instance_its_own_started_together() -> None:
    specs = plan_instances(Topology(device="cuda"), "/m", None, [0, 1], gpu_ids=[0, 1])
    assert gpus_of(specs) == ["0", "1"]
    assert memory_of(specs) == [None, None]  # vLLM's own 0.9
    assert [s.start_stage for s in specs] == [0, 0]


def test_four_instances_at_half_a_gpu_fill_two_gpus_in_order_two_stages() -> None:
    topology = Topology(
        prefill=RoleSpec(count=2), decode=RoleSpec(count=2), device="cuda", gpus_per_instance=0.5
    )
    specs = plan_instances(topology, "/m", None, [0, 1], gpu_ids=[0, 1])
    assert [(s.name, g) for s, g in zip(specs, gpus_of(specs), strict=True)] == [
        ("prefill-0", "0"),
        ("prefill-1", "0"),
        ("decode-0", "1"),
        ("decode-1", "1"),
    ]
    assert memory_of(specs) == ["0.45"] * 4
    assert [s.start_stage for s in specs] == [0, 1, 0, 1]  # the two GPUs start side by side


def test_instances_per_gpu_splits_vllms_memory_share_rounded_down() -> None:
    topology = Topology(
        prefill=RoleSpec(count=1), decode=RoleSpec(count=2), device="cuda", instances_per_gpu=3
    )
    specs = plan_instances(topology, "/m", None, [0, 1], gpu_ids=[0])
    assert gpus_of(specs) == ["0", "0", "0"]
    assert memory_of(specs) == ["0.30"] * 3
    assert [s.start_stage for s in specs] == [0, 1, 2]
    assert gpu_memory_share(4) == "0.22"


def test_a_memory_share_the_user_set_is_left_alone() -> None:
    topology = Topology(device="cuda", decode=RoleSpec(args=("--gpu-memory-utilization=0.6",)))
    prefill, decode = plan_instances(topology, "/m", None, [0, 1], gpu_ids=[0])
    assert arg_value(prefill, "--gpu-memory-utilization") == "0.45"
    assert [a for a in decode.args if a.startswith("--gpu-memory")] == ["--gpu-memory-utilization=0.6"]


def test_cuda_instances_let_ucx_read_kv_over_cuda_ipc_without_nvlink_and_cpu_ones_do_not() -> None:
    # Without it a NIXL READ between two processes on one NVLink-less GPU went over tcp: 0.5 GB/s on one H200.
    for spec in plan_instances(Topology(device="cuda"), "/m", None, [0, 1], gpu_ids=["0"]):
        assert dict(spec.env)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    for spec in plan_instances(Topology(device="cpu"), "/m", None, [0, 1]):
        assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in dict(spec.env)


def test_cuda_visible_devices_is_respected_in_its_order() -> None:
    gpus = visible_gpus("3,5", num_host_gpus=8)
    assert gpus == ["3", "5"]
    specs = plan_instances(Topology(device="cuda"), "/m", None, [0, 1], gpu_ids=gpus)
    assert gpus_of(specs) == ["3", "5"]
    specs = plan_instances(Topology(device="cuda"), "/m", None, [0, 1], gpu_ids=visible_gpus("5", 8))
    assert gpus_of(specs) == ["5", "5"]


def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does() -> None:
    assert visible_gpus(None, 2) == ["0", "1"]
    assert visible_gpus(None, None) == []
    assert visible_gpus("", 4) == []  # set but empty hides every GPU
    assert visible_gpus("1, 0", 4) == ["1", "0"]
    assert visible_gpus("0,7,1", 4) == ["0"]  # CUDA stops at the first invalid entry
    assert visible_gpus("0,-1,1", 4) == ["0"]
    assert visible_gpus("GPU-8f2a,MIG-1c", 1) == ["GPU-8f2a", "MIG-1c"]
    assert visible_gpus("6", None) == ["6"]  # host GPUs unknown: trust the variable


@pytest.mark.parametrize(
    ("placement", "num_gpus", "message"),
    [
        ({"gpus_per_instance": 0.5}, 0, r"needs 1 GPUs \(2 instances, 2 per GPU\), but 0 are available"),
        ({"instances_per_gpu": 1}, 1, r"needs 2 GPUs \(2 instances, 1 per GPU\), but 1 are available \(visible GPUs: 0\)"),
        ({"gpus_per_instance": 1}, 1, r"needs 2 GPUs \(2 instances x gpus_per_instance=1\)"),
    ],
)  # fmt: skip
def test_too_few_visible_gpus_names_what_is_needed_and_what_is_there(
    placement: dict[str, float], num_gpus: int, message: str
) -> None:
    topology = Topology(device="cuda", **placement)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        plan_instances(topology, "/m", None, [0, 1], gpu_ids=range(num_gpus))


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        ({"gpus_per_instance": 0.3}, r"gpus_per_instance=0.3 is not 1/N .* instances_per_gpu: N"),
        ({"gpus_per_instance": 1.5}, r"whole number of GPUs when >= 1, got 1.5"),
        ({"gpus_per_instance": 0}, r"gpus_per_instance must be a number > 0, got 0"),
        ({"instances_per_gpu": 0}, r"instances_per_gpu must be a whole number >= 1, got 0"),
        ({"instances_per_gpu": 1.5}, r"instances_per_gpu must be a whole number >= 1, got 1.5"),
        (
            {"gpus_per_instance": 0.5, "instances_per_gpu": 2},
            r"sets both gpus_per_instance .* set one of them",
        ),
    ],
)
def test_a_gpu_placement_that_cannot_be_honoured_is_refused_naming_the_field(
    placement: dict[str, float], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Topology(device="cuda", **placement)  # type: ignore[arg-type]


def test_gpu_placement_comes_from_the_topology_file_as_written() -> None:
    topology = topology_from_mapping({"device": "cuda", "gpus_per_instance": 0.25})
    specs = plan_instances(topology, "/m", None, [0], gpu_ids=[0])
    assert memory_of(specs) == ["0.22", "0.22"] and [s.start_stage for s in specs] == [0, 1]


def test_cpu_instances_all_start_together() -> None:
    assert [
        s.start_stage for s in plan_instances(Topology(decode=RoleSpec(count=3)), "/m", None, range(4))
    ] == [0] * 4


def test_each_instance_binds_reports_and_advertises_its_own_address() -> None:
    topology = Topology(prefill=RoleSpec(hosts=("10.9.0.2",)), decode=RoleSpec(hosts=("10.9.0.3",)))
    prefill, decode = plan_instances(topology, "/models/m", None, [0, 1])
    for spec, address in ((prefill, "10.9.0.2"), (decode, "10.9.0.3")):
        assert arg_value(spec, "--host") == address
        assert spec.url == f"http://{address}:{spec.port}"
        # What prefill puts into kv_transfer_params as remote_host: decode dials exactly this.
        assert dict(spec.env)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == address
    assert [s.url for s in plan_sim_instances(topology)] == [prefill.url, decode.url]


def test_a_wildcard_host_binds_everywhere_but_the_side_channel_names_loopback() -> None:
    for spec in plan_instances(Topology(host="0.0.0.0"), "/models/m", None, [0, 1]):
        assert arg_value(spec, "--host") == "0.0.0.0"
        assert spec.url.startswith("http://127.0.0.1:")
        assert dict(spec.env)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"


def test_cpu_instances_give_nixls_progress_thread_a_pause_and_cuda_ones_keep_nixls_default() -> None:
    # NIXL's progress thread spins a core per instance (engines/enginesite/sitecustomize.py): on a CPU host
    # those are the engines' own cores.
    for spec in plan_instances(Topology(), "/models/m", None, [0, 1]):
        assert dict(spec.env)["PDSERVE_NIXL_PROGRESS_DELAY_US"] == "100"
    for spec in plan_instances(Topology(device="cuda"), "/models/m", None, [0, 1], gpu_ids=[0, 1]):
        assert "PDSERVE_NIXL_PROGRESS_DELAY_US" not in dict(spec.env)
    explicit = Topology(device="cuda", nixl_progress_delay_us=50)
    assert (
        dict(plan_instances(explicit, "/m", None, [0], gpu_ids=[0, 1])[0].env)[
            "PDSERVE_NIXL_PROGRESS_DELAY_US"
        ]
        == "50"
    )
    nixls_own = Topology(nixl_progress_delay_us=0)
    assert "PDSERVE_NIXL_PROGRESS_DELAY_US" not in dict(plan_instances(nixls_own, "/m", None, [0, 1])[0].env)


@pytest.mark.parametrize("delay", [-1, 1.5, True, "100"])
def test_a_nixl_progress_delay_that_is_not_whole_microseconds_is_refused(delay: object) -> None:
    with pytest.raises(ConfigError, match="nixl_progress_delay_us"):
        Topology(nixl_progress_delay_us=delay)  # type: ignore[arg-type]


def test_an_elastic_pool_on_cpu_is_n_instances_of_any_role_named_after_it() -> None:
    topology = Topology(elastic=RoleSpec(count=3), first_port=9100, first_side_channel_port=5800)
    specs = plan_instances(topology, "/models/m", None, [0, 1, 2])
    assert [s.name for s in specs] == ["elastic-0", "elastic-1", "elastic-2"]
    assert [s.port for s in specs] == [9100, 9101, 9102]
    assert [s.side_channel_port for s in specs] == [5800, 5801, 5802]
    assert binds(specs) == ["0", "1", "2"]
    for spec in specs:
        assert json.loads(arg_value(spec, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_consumer",  # never the deprecated kv_both: the request's params decide the role
            "kv_buffer_device": "cpu",
        }
        assert spec.args.count("--enable-prompt-tokens-details") == 1  # the proof on whichever decodes
        assert "--no-async-scheduling" not in spec.args  # vLLM's CPU platform runs none already
        env = dict(spec.env)
        assert env["VLLM_SERVER_DEV_MODE"] == "1"  # it may decode: the lease guard may reset its cache
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(spec.side_channel_port)


def test_an_elastic_pool_on_cuda_runs_without_async_scheduling_unless_the_user_says() -> None:
    topology = Topology(elastic=RoleSpec(count=2), device="cuda")
    specs = plan_instances(topology, "/m", None, [0], gpu_ids=[0, 1])
    for spec in specs:
        config = json.loads(arg_value(spec, "--kv-transfer-config"))
        assert (config["kv_role"], config["kv_buffer_device"]) == ("kv_consumer", "cuda")
        assert spec.args.count("--no-async-scheduling") == 1
    # kv_both (bench --compare) takes any role too, so it gets the same; a dedicated pair does not.
    both = plan_instances(Topology(device="cuda", kv_both=True), "/m", None, [0], gpu_ids=[0, 1])
    assert all("--no-async-scheduling" in s.args for s in both)
    pair = plan_instances(Topology(device="cuda"), "/m", None, [0], gpu_ids=[0, 1])
    assert not any("--no-async-scheduling" in s.args for s in pair)
    told = Topology(elastic=RoleSpec(count=2, args=("--async-scheduling",)), device="cuda")
    for spec in plan_instances(told, "/m", None, [0], gpu_ids=[0, 1]):
        assert "--no-async-scheduling" not in spec.args and spec.args[-1] == "--async-scheduling"


def test_an_elastic_pool_of_simulators_runs_role_both_with_its_own_args() -> None:
    topology = Topology(engine="sim", elastic=RoleSpec(count=3, args=("--kv-lease-s", "9")), first_port=9300)
    sims = plan_sim_instances(topology)
    assert [s.name for s in sims] == ["elastic-0", "elastic-1", "elastic-2"]
    assert [arg_value(s, "--both") for s in sims] == ["1"] * 3
    assert [(arg_value(s, "--prefill"), arg_value(s, "--decode")) for s in sims] == [("0", "0")] * 3
    assert [arg_value(s, "--first-port") for s in sims] == ["9300", "9301", "9302"]
    assert all(s.args[-2:] == ("--kv-lease-s", "9") for s in sims)


def test_an_elastic_pool_must_not_set_what_the_plan_owns() -> None:
    with pytest.raises(ConfigError, match=r"topology\.elastic\.args must not set --port"):
        plan_instances(Topology(elastic=RoleSpec(count=2, args=("--port", "1"))), "/m", None, [0, 1])
