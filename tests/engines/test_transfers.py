"""Transfer counters read from decode's /metrics: the evidence that KV moved."""

from __future__ import annotations

from pdserve.engines.transfers import TransferCounts
from pdserve.prometheus import parse_prometheus

SAMPLE = """\
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="pdserve-tiny"} 3.0
vllm:nixl_xfer_time_seconds_count{engine="1",model_name="pdserve-tiny"} 1.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="pdserve-tiny"} 0.0
"""


def test_transfer_delta_reads_as_what_happened_between_two_scrapes() -> None:
    before = TransferCounts(4, 0, 1000)
    after = TransferCounts.of(parse_prometheus(SAMPLE.replace("} 3.0", "} 4.0")))
    delta = after - before
    assert (delta.successful, delta.failed) == (1.0, 0.0)
