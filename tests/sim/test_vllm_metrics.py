"""/metrics: vLLM's names, labels and number format, and counts that follow what was served."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import aiohttp
import pytest
from sim_rig import MODEL, PREFILL_PARAMS, Sims

from pdserve.prometheus import parse_prometheus
from pdserve.sim.vllm_metrics import Histogram, SimMetrics, go_float

LABELS = f'{{engine="0",model_name="{MODEL}"}}'
NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred", "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_notifications_after_expiry_total",
]  # fmt: skip


@dataclass
class Counters:
    num_running: int = 1
    num_waiting: int = 2
    kv_usage: float = 0.25
    prefix_cache_queries: int = 100
    prefix_cache_hits: int = 40
    num_preemptions: int = 0
    num_kv_expired: int = 3
    num_notifications_after_expiry: int = 2
    num_pulls_failed: int = 1
    prompt_tokens_computed: int = 60
    prompt_tokens_cached: int = 40
    prompt_tokens_remote: int = 7
    generation_tokens: int = 9


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0.0"),
        (1, "1.0"),
        (0.25, "0.25"),
        (2048, "2048.0"),
        (2097152, "2.097152e+06"),
        (8589934592, "8.589934592e+09"),
        (1796212061.3414361, "1.7962120613414361e+09"),
        (math.inf, "+Inf"),
    ],
)
def test_numbers_print_as_prometheus_client_prints_them(value: float, text: str) -> None:
    assert go_float(value) == text


def test_histogram_buckets_are_upper_bounds() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.counts == [2, 1, 1] and h.count == 4 and h.sum == pytest.approx(2.65)


def test_rendering_uses_vllms_names_labels_and_order() -> None:
    metrics = SimMetrics(MODEL)
    metrics.ttft.observe(0.003)
    metrics.record_finish("length")
    text = metrics.render(Counters())
    assert text.endswith("\n")
    for name in NAMES:
        if name.endswith(("_seconds", "_transferred")):
            kind = "histogram"
        else:
            kind = "counter" if name.endswith("_total") else "gauge"
        assert f"# TYPE {name} {kind}\n" in text
    assert f"vllm:num_requests_waiting{LABELS} 2.0\n" in text
    assert f"vllm:prompt_tokens_total{LABELS} 107.0\n" in text  # computed + cached + pulled
    # prometheus_client sorts label names: engine, finished_reason/le, model_name.
    assert (
        f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 1.0\n'
        in text
    )
    assert (
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{MODEL}"}} 0.0\n' in text
    )
    assert (
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.005",model_name="{MODEL}"}} 1.0\n' in text
    )
    assert (
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 1.0\n' in text
    )
    assert (
        f'vllm:nixl_bytes_transferred_bucket{{engine="0",le="2.097152e+06",model_name="{MODEL}"}} 0.0\n'
        in text
    )
    histogram_lines = [
        line for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds")
    ]
    assert histogram_lines[-2].startswith("vllm:time_to_first_token_seconds_count")  # buckets, count, sum
    assert histogram_lines[-1].startswith("vllm:time_to_first_token_seconds_sum")
    samples = parse_prometheus(text)
    assert samples["vllm:nixl_num_kv_expired_reqs_total"] == 3
    assert samples["vllm:nixl_num_notifications_after_expiry_total"] == 2
    assert samples["vllm:request_success_total"] == 1


def test_label_values_are_escaped() -> None:
    text = SimMetrics('a"b\\c').render(Counters())
    assert 'model_name="a\\"b\\\\c"' in text


async def test_live_metrics_follow_what_was_served(sims: Sims, http: aiohttp.ClientSession) -> None:
    async def scrape(url: str) -> dict[str, float]:
        async with http.get(f"{url}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
            text = await resp.text()
        for name in NAMES:
            assert re.search(rf"^# TYPE {re.escape(name)} ", text, re.M), name
        return parse_prometheus(text)

    before = await scrape(sims.both)
    body = {"model": MODEL, "prompt": "metrics please, five tokens", "max_tokens": 5}
    for stream in (False, True):
        async with http.post(f"{sims.both}/v1/completions", json={**body, "stream": stream}) as resp:
            assert resp.status == 200
            await resp.read()
    after = await scrape(sims.both)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 10
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 2
    assert (
        after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"]
        == 2
    )
    assert (
        after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"]
        == 8
    )
    assert (
        after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"]
        == 2
    )
    # The same prompt again: its full blocks come from the prefix cache.
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]

    pd_before = await scrape(sims.decode)
    async with http.post(
        f"{sims.prefill}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    ) as resp:
        params = (await resp.json())["kv_transfer_params"]
    async with http.post(
        f"{sims.decode}/v1/completions", json={**body, "kv_transfer_params": params}
    ) as resp:
        assert resp.status == 200
    pd_after = await scrape(sims.decode)
    assert pd_after["vllm:nixl_xfer_time_seconds_count"] == pd_before["vllm:nixl_xfer_time_seconds_count"] + 1
    assert pd_after["vllm:nixl_bytes_transferred_sum"] > pd_before["vllm:nixl_bytes_transferred_sum"]
    assert (
        pd_after["vllm:nixl_num_failed_transfers_total"] == pd_before["vllm:nixl_num_failed_transfers_total"]
    )
