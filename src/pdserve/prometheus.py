"""Prometheus text exposition: parsing what vLLM (or the simulator) serves on ``/metrics``, and the
vLLM metric names pdserve reads. Pure functions: the proxy's load scrapes, verify and the launcher's
callers all parse through here."""

from __future__ import annotations

import math
from typing import Final

XFER_COUNT: Final = "vllm:nixl_xfer_time_seconds_count"  # successful NIXL transfers (decode side)
XFER_TIME_SUM: Final = "vllm:nixl_xfer_time_seconds_sum"
XFER_FAILED: Final = "vllm:nixl_num_failed_transfers_total"
KV_EXPIRED: Final = "vllm:nixl_num_kv_expired_reqs_total"  # counted on prefill when a lease runs out
BYTES_SUM: Final = "vllm:nixl_bytes_transferred_sum"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
NUM_RUNNING: Final = "vllm:num_requests_running"
NUM_WAITING: Final = "vllm:num_requests_waiting"


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
