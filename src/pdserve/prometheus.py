"""Prometheus text exposition: parsing what vLLM (or the simulator) serves on ``/metrics``, and the
vLLM metric names pdserve reads. Pure functions: the proxy's load scrapes, verify and the launcher's
callers all parse through here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

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
PROMPT_TOKENS: Final = "vllm:prompt_tokens_total"  # counters: they move only while the engine steps
GENERATION_TOKENS: Final = "vllm:generation_tokens_total"


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name → value summed over its label sets (``# HELP``/``# TYPE`` lines skipped)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = line.find("{")
        if name_end == -1:
            name, _, rest = line.partition(" ")
        else:
            name = line[:name_end]
            rest = line[line.rfind("}") + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
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
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace == -1:
            name, _, rest = line.partition(" ")
            labels: dict[str, str] = {}
        else:
            close = line.rfind("}")
            name, labels, rest = line[:brace], _labels(line[brace + 1 : close]), line[close + 1 :]
        fields = rest.split()
        try:
            samples.append(Sample(name, labels, float(fields[0])))
        except (ValueError, IndexError):
            continue
    return samples


def labels_of(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample called ``name``, or None when there is none."""
    return next((s.labels for s in parse_samples(text) if s.name == name), None)
