"""What the instances and the proxy counted during one benchmark run: the reasons behind a verdict.

Before and after each run every instance's ``/metrics`` and the proxy's are read; the difference holds
the run's KV transfers (decode's ``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred``
histograms: count, seconds, bytes) and the proxy's phase times (``pdserve_prefill_seconds``, ...). While
the run goes, a thread reads each instance's ``vllm:num_requests_waiting`` every half second: vLLM's own
queue, where a request waits for a batch slot (or, on decode, for its KV to arrive).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.errors import MetricsUnreadable
from pdserve.prometheus import EngineScrape, scrape

_SAMPLE_INTERVAL_S = 0.5
PROXY_PHASES = ("prefill", "handoff_gap", "decode_first_byte", "ttft")
_SUSPECT = "pdserve_kv_handoffs_suspect_total"
_RETRIES = "pdserve_retries_total"


def scrape_sum(urls: Sequence[str], timeout: float = 5.0) -> dict[str, float]:
    """``/metrics`` of every URL, each sample summed over labels and URLs; an unreachable URL adds nothing."""
    totals: dict[str, float] = {}
    for url in urls:
        try:
            samples = scrape(url, timeout)
        except MetricsUnreadable:
            continue
        for name, value in samples.items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


@dataclass(frozen=True)
class PoolLoad:
    """vLLM's queue on one pool of instances during a run (sampled; summed over the pool's instances)."""

    waiting_mean: float
    waiting_max: float
    running_mean: float
    num_samples: int


class QueueSampler:
    """Reads ``num_requests_waiting``/``running`` of each pool every half second on a thread of its own."""

    def __init__(self, pools: Mapping[str, Sequence[str]]) -> None:
        self._pools = {name: tuple(urls) for name, urls in pools.items()}
        self._samples: dict[str, list[tuple[float, float]]] = {name: [] for name in self._pools}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-queue-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_INTERVAL_S):
            for name, urls in self._pools.items():
                pool = EngineScrape.of(scrape_sum(urls, timeout=2.0))
                if pool.num_waiting is not None:
                    self._samples[name].append((pool.num_waiting, pool.num_running or 0.0))

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def loads(self) -> dict[str, PoolLoad]:
        out = {}
        for name, samples in self._samples.items():
            if samples:
                waiting = [w for w, _ in samples]
                out[name] = PoolLoad(
                    sum(waiting) / len(waiting),
                    max(waiting),
                    sum(r for _, r in samples) / len(samples),
                    len(samples),
                )
        return out


@dataclass(frozen=True)
class RunEvidence:
    num_transfers: int  # successful NIXL reads, all instances together
    num_failed_transfers: int
    transfer_s_sum: float
    transfer_bytes_sum: float
    proxy_ms: Mapping[str, float]  # mean per phase (PROXY_PHASES) over the run's requests, where seen
    queues: Mapping[str, PoolLoad]  # pool name ("prefill", "decode", "colocated") → its queue
    # What went wrong on the way and was repaired (the requests still succeeded, but slowly):
    num_expired_leases: int = 0  # prefill freed KV nobody had read within its lease (vLLM's counter)
    num_suspect_handoffs: int = 0  # the proxy withheld decode's answer and prefilled again (lease guard)
    num_retries: int = 0  # attempts the proxy moved to another instance (or repeated), any phase

    @property
    def transfer_ms_mean(self) -> float | None:
        return self.transfer_s_sum / self.num_transfers * 1000 if self.num_transfers else None

    @property
    def transfer_bytes_mean(self) -> float | None:
        return self.transfer_bytes_sum / self.num_transfers if self.num_transfers else None

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        return self.transfer_bytes_sum / self.transfer_s_sum if self.transfer_s_sum > 0 else None

    @classmethod
    def between(
        cls,
        before: Mapping[str, float],
        after: Mapping[str, float],
        proxy_before: Mapping[str, float],
        proxy_after: Mapping[str, float],
        queues: Mapping[str, PoolLoad],
    ) -> RunEvidence:
        def delta(name: str, b: Mapping[str, float], a: Mapping[str, float]) -> float:
            return a.get(name, 0.0) - b.get(name, 0.0)

        grown = EngineScrape.of({name: delta(name, before, after) for name in {*before, *after}})
        proxy_ms = {}
        for phase in PROXY_PHASES:
            count = delta(f"pdserve_{phase}_seconds_count", proxy_before, proxy_after)
            if count > 0:
                proxy_ms[phase] = (
                    delta(f"pdserve_{phase}_seconds_sum", proxy_before, proxy_after) / count * 1000
                )
        return cls(
            num_transfers=round(grown.num_transfers or 0.0),
            num_failed_transfers=round(grown.num_failed or 0.0),
            transfer_s_sum=grown.transfer_seconds or 0.0,
            transfer_bytes_sum=grown.num_bytes or 0.0,
            proxy_ms=proxy_ms,
            queues=dict(queues),
            num_expired_leases=round(grown.num_expired or 0.0),
            num_suspect_handoffs=round(delta(_SUSPECT, proxy_before, proxy_after)),
            num_retries=round(delta(_RETRIES, proxy_before, proxy_after)),
        )
