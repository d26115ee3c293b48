"""Reading a vLLM instance's Prometheus ``/metrics``: the evidence that KV really moved.

HTTP 200 proves only that an answer came back. A transfer is proven by decode's
``vllm:nixl_xfer_time_seconds_count`` (one sample per successful NIXL read) rising while
``vllm:nixl_num_failed_transfers_total`` does not.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from pdserve.errors import VerifyError

XFER_COUNT: Final = "vllm:nixl_xfer_time_seconds_count"  # successful transfers (decode side)
XFER_FAILED: Final = "vllm:nixl_num_failed_transfers_total"
KV_EXPIRED: Final = "vllm:nixl_num_kv_expired_reqs_total"  # counted on prefill when a lease runs out
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
BYTES_SUM: Final = "vllm:nixl_bytes_transferred_sum"


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


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """The summed samples of ``<url>/metrics``; VerifyError if the instance does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
            return parse_prometheus(resp.read().decode("utf-8", "replace"))
    except (OSError, urllib.error.URLError) as exc:
        raise VerifyError(f"cannot read {url}/metrics: {exc}") from exc


@dataclass(frozen=True)
class TransferCounts:
    """Decode-side NIXL counters at one moment, summed over the given instances."""

    successful: float
    failed: float
    bytes: float

    @classmethod
    def of(cls, samples: Mapping[str, float]) -> TransferCounts:
        return cls(samples.get(XFER_COUNT, 0.0), samples.get(XFER_FAILED, 0.0), samples.get(BYTES_SUM, 0.0))

    def __add__(self, other: TransferCounts) -> TransferCounts:
        return TransferCounts(
            self.successful + other.successful, self.failed + other.failed, self.bytes + other.bytes
        )

    def __sub__(self, other: TransferCounts) -> TransferCounts:
        return self + TransferCounts(-other.successful, -other.failed, -other.bytes)


def transfer_counts(urls: list[str], timeout: float = 5.0) -> TransferCounts:
    """The counters summed over ``urls`` (the decode instances)."""
    return sum((TransferCounts.of(scrape(u, timeout)) for u in urls), TransferCounts(0.0, 0.0, 0.0))
