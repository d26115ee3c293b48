"""Prometheus text exposition: reading and parsing what vLLM (or the simulator, or pdserve's proxy) serves
on ``/metrics``, and the vLLM metric names pdserve reads. The proxy's load scrapes parse through here;
every blocking reader (verify, doctor, bench, top) reads through ``scrape``/``scrape_text``, which raise
``MetricsUnreadable`` and leave each caller its own policy: fail, report, skip or show."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from pdserve import httpclient
from pdserve.errors import MetricsUnreadable, Unreachable

XFER_COUNT: Final = "vllm:nixl_xfer_time_seconds_count"  # successful NIXL transfers (decode side)
XFER_TIME_SUM: Final = "vllm:nixl_xfer_time_seconds_sum"
XFER_FAILED: Final = "vllm:nixl_num_failed_transfers_total"
KV_EXPIRED: Final = "vllm:nixl_num_kv_expired_reqs_total"  # counted on prefill when a lease runs out
BYTES_SUM: Final = "vllm:nixl_bytes_transferred_sum"
DESCRIPTORS_SUM: Final = "vllm:nixl_num_descriptors_sum"
NOTIFS_AFTER_EXPIRY: Final = "vllm:nixl_num_notifications_after_expiry_total"  # prefill: a late pull
CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"  # a gauge of 1 whose labels are the CacheConfig
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
NUM_RUNNING: Final = "vllm:num_requests_running"
NUM_WAITING: Final = "vllm:num_requests_waiting"
# of those waiting, by reason="capacity" | "deferred" (deferred: a remote KV not yet come, among others)
WAITING_BY_REASON: Final = "vllm:num_requests_waiting_by_reason"
# arrival at the engine to its first token: for a decode, its queue and the KV pull included
TTFT_SUM: Final = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT: Final = "vllm:time_to_first_token_seconds_count"
PROMPT_TOKENS: Final = "vllm:prompt_tokens_total"  # counters: they move only while the engine steps
GENERATION_TOKENS: Final = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class EngineScrape:
    """What pdserve reads of one vLLM instance's /metrics (or of a pool's, summed); None where the engine
    does not export the metric."""

    num_running: float | None = None
    num_waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    num_transfers: float | None = None  # successful NIXL reads: they move on decode
    transfer_seconds: float | None = None
    num_bytes: float | None = None
    num_failed: float | None = None  # failed transfers, handshakes, notifications: decode
    num_expired: float | None = None  # leases that ran out unpulled: prefill

    @classmethod
    def of(cls, samples: Mapping[str, float]) -> EngineScrape:
        """From ``parse_prometheus``'s (or ``scrape``'s) samples."""
        s = samples
        return cls(s.get(NUM_RUNNING), s.get(NUM_WAITING), s.get(KV_USAGE), s.get(XFER_COUNT),
                   s.get(XFER_TIME_SUM), s.get(BYTES_SUM), s.get(XFER_FAILED), s.get(KV_EXPIRED))  # fmt: skip


def scrape_text(url: str, timeout: float = 5.0) -> str:
    """The text of ``<url>/metrics``; MetricsUnreadable when it does not answer, or answers other than 200."""
    try:
        response = httpclient.get(f"{url}/metrics", timeout)
    except Unreachable as exc:
        raise MetricsUnreadable(str(exc)) from exc
    if response.status != 200:
        raise MetricsUnreadable(f"{url}/metrics answered {response.status}")
    return response.body.decode("utf-8", "replace")


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """``<url>/metrics`` parsed by ``parse_prometheus``; MetricsUnreadable as ``scrape_text``."""
    return parse_prometheus(scrape_text(url, timeout))


def _sample_lines(text: str) -> Iterator[tuple[str, str | None, float]]:
    """(name, the text between the braces or None, value) of each sample line; comments and lines
    whose value is not a number are skipped."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace == -1:
            name, _, rest = line.partition(" ")
            labels = None
        else:
            close = line.rfind("}")
            name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
        fields = rest.split()
        try:
            value = float(fields[0])
        except (ValueError, IndexError):
            continue
        yield name, labels, value


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name → value summed over its label sets (``# HELP``/``# TYPE`` lines skipped)."""
    totals: dict[str, float] = {}
    for name, _labels_text, value in _sample_lines(text):
        if not math.isnan(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


_ESCAPES: Final = {"n": "\n", "\\": "\\", '"': '"'}


def _labels(text: str) -> dict[str, str]:
    """``a="1",b="x\\"y"`` → {"a": "1", "b": 'x"y'}: values may hold commas, braces and escapes."""
    labels: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.find("=", i)
        if eq == -1 or eq + 1 >= len(text) or text[eq + 1] != '"':
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j, value = eq + 2, []
        while j < len(text) and text[j] != '"':
            if text[j] == "\\" and j + 1 < len(text):
                value.append(_ESCAPES.get(text[j + 1], text[j + 1]))
                j += 2
                continue
            value.append(text[j])
            j += 1
        labels[key] = "".join(value)
        i = j + 1
    return labels


def parse_samples(text: str) -> list[Sample]:
    """Every sample with its labels, in order (for info gauges such as ``vllm:cache_config_info``,
    whose meaning is in the labels, not the value). NaN samples are kept: a label set is still a fact."""
    return [
        Sample(name, {} if labels is None else _labels(labels), value)
        for name, labels, value in _sample_lines(text)
    ]


def sum_labelled(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    wanted = labels.items()
    return sum(
        s.value
        for s in parse_samples(text)
        if s.name == name and wanted <= s.labels.items() and not math.isnan(s.value)
    )


def labels_of(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample called ``name``, or None when there is none."""
    return next((s.labels for s in parse_samples(text) if s.name == name), None)
