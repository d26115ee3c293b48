"""``GET /metrics`` in vLLM's Prometheus names, for what the simulator models.

Names, help texts, bucket bounds and label order are vLLM 0.32's (``vllm/v1/metrics/loggers.py``,
``vllm/v1/metrics/buckets.py``, ``.../kv_connector/v1/nixl/stats.py``) and the text matches what
``prometheus_client`` prints, so dashboards and ``pdserve verify`` read a sim as they read vLLM.
Not emitted: ``*_created`` samples and the families the sim does not model (LoRA, spec decode, MFU…).

Hand-rolled because it is cheap: a histogram observation is one bisect and three additions, and a
scrape renders a few dozen lines.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Final, Protocol

REQUEST_LATENCY_BUCKETS: Final = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                  50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                       7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
NIXL_XFER_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS: Final = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB … 8 GiB
FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")


class EngineCounters(Protocol):
    """The engine core's ``EngineStats`` as far as metrics read it."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def num_kv_expired(self) -> int: ...
    @property
    def num_notifications_after_expiry(self) -> int: ...
    @property
    def num_pulls_failed(self) -> int: ...
    @property
    def prompt_tokens_computed(self) -> int: ...
    @property
    def prompt_tokens_cached(self) -> int: ...
    @property
    def prompt_tokens_remote(self) -> int: ...
    @property
    def generation_tokens(self) -> int: ...


def go_float(value: float) -> str:
    """A float as ``prometheus_client`` prints it (Go's format: ``1.0``, ``2.097152e+06``, ``+Inf``)."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    s = repr(float(value))
    dot = s.find(".")
    if value > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is the +Inf overflow
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class SimMetrics:
    """One instance's request-level metrics (observed by the HTTP layer) plus the engine's counters."""

    def __init__(self, model_name: str, engine_index: int = 0) -> None:
        self._model = _escape(model_name)
        self._engine = str(engine_index)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.nixl_xfer_time = Histogram(NIXL_XFER_BUCKETS)  # one sample per successful pull (decode)
        self.nixl_bytes = Histogram(NIXL_BYTES_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)

    def record_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def _labels(self, **extra: str) -> str:
        pairs = {"engine": self._engine, "model_name": self._model, **extra}
        return "{" + ",".join(f'{k}="{pairs[k]}"' for k in sorted(pairs)) + "}"

    def render(self, stats: EngineCounters) -> str:
        out: list[str] = []
        base = self._labels()

        def family(name: str, kind: str, doc: str) -> None:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")

        def sample(name: str, kind: str, doc: str, value: float) -> None:
            family(name, kind, doc)
            out.append(f"{name}{base} {go_float(value)}\n")

        def histogram(name: str, doc: str, h: Histogram) -> None:
            family(name, "histogram", doc)
            cumulative = 0
            for bound, n in zip((*h.bounds, math.inf), h.counts, strict=True):
                cumulative += n
                out.append(f"{name}_bucket{self._labels(le=go_float(bound))} {go_float(cumulative)}\n")
            out.append(f"{name}_count{base} {go_float(h.count)}\n{name}_sum{base} {go_float(h.sum)}\n")

        sample("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               stats.num_running)  # fmt: skip
        sample("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               stats.num_waiting)  # fmt: skip
        sample(
            "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage
        )
        sample("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries)  # fmt: skip
        sample("vllm:prefix_cache_hits_total", "counter",
               "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits)  # fmt: skip
        sample("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
               stats.num_preemptions)  # fmt: skip
        computed, cached, remote = (
            stats.prompt_tokens_computed,
            stats.prompt_tokens_cached,
            stats.prompt_tokens_remote,
        )
        sample("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               computed + cached + remote)  # fmt: skip
        family("vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source.")
        for source, value in (("local_compute", computed), ("local_cache_hit", cached),
                              ("external_kv_transfer", remote)):  # fmt: skip
            out.append(f"vllm:prompt_tokens_by_source_total{self._labels(source=source)} {go_float(value)}\n")
        sample("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               stats.generation_tokens)  # fmt: skip
        family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
        for reason, n in self.finished.items():
            out.append(f"vllm:request_success_total{self._labels(finished_reason=reason)} {go_float(n)}\n")
        histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft
        )
        histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl
        )
        histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e
        )
        histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                  self.nixl_xfer_time)  # fmt: skip
        histogram("vllm:nixl_bytes_transferred",
                  "Histogram of bytes transferred per NIXL KV Cache transfers.", self.nixl_bytes)  # fmt: skip
        sample("vllm:nixl_num_failed_transfers_total", "counter",
               "Number of failed NIXL KV Cache transfers, including handshake and notification failures. "
               "NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
               stats.num_pulls_failed)  # fmt: skip
        sample("vllm:nixl_num_kv_expired_reqs_total", "counter",
               "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
               stats.num_kv_expired)  # fmt: skip
        sample("vllm:nixl_num_notifications_after_expiry_total", "counter",
               "Number of completion notifications for requests that were no longer tracked, usually "
               "because their KV lease expired. The KV blocks may have been reused before the transfer "
               "finished. Counted per notification (one per remote rank), not per request.",
               stats.num_notifications_after_expiry)  # fmt: skip
        return "".join(out)
