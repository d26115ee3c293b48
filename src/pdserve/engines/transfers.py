"""Reading a vLLM instance's Prometheus ``/metrics``: the evidence that KV really moved.

HTTP 200 proves only that an answer came back. A transfer is proven by decode's
``vllm:nixl_xfer_time_seconds_count`` (one sample per successful NIXL read) rising while
``vllm:nixl_num_failed_transfers_total`` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.errors import MetricsUnreadable, VerifyError
from pdserve.prometheus import BYTES_SUM, XFER_COUNT, XFER_FAILED, scrape


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
    """The counters summed over ``urls`` (the decode instances); VerifyError if one cannot be read:
    without every decode's counters there is no proof."""
    try:
        return sum((TransferCounts.of(scrape(u, timeout)) for u in urls), TransferCounts(0.0, 0.0, 0.0))
    except MetricsUnreadable as exc:
        raise VerifyError(f"cannot read the transfer counters: {exc}") from exc
