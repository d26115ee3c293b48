"""vLLM's benchmark result JSON (``vllm bench serve --save-result --save-detailed``) as a typed summary.

The file stays as vLLM wrote it (the record); this reads what pdserve reasons with. Keys, as vLLM 0.32's
``vllm/benchmarks/serve.py`` writes them: ``completed``, ``failed``, ``duration``, ``request_throughput``,
``output_throughput``, ``request_goodput`` (null without ``--goodput``), ``{mean,median,p50,p90,p99}_
{ttft,tpot,itl,e2el}_ms``; with ``--save-detailed`` also per request ``ttfts`` and ``latencies`` (seconds,
0 for a failed request), ``itls`` (a list of seconds each), ``output_lens`` and ``errors``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pdserve.errors import BenchError

METRICS: Final = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Latency:
    """One metric's distribution over a run, in milliseconds, as vLLM computed it."""

    mean: float
    median: float
    p90: float
    p99: float


@dataclass(frozen=True)
class BenchResult:
    label: str  # the run's name (e.g. "disaggregated@4")
    request_rate: float  # offered requests/s; inf: all at once
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests/s
    output_throughput: float  # generated tokens/s
    goodput: float | None  # requests/s that met every SLO; None: no SLO given
    mean_input_len: float
    mean_output_len: float
    ttft: Latency
    tpot: Latency
    itl: Latency
    e2el: Latency
    # Per successful request (milliseconds), for CDFs; empty if the file was saved without details.
    ttfts_ms: tuple[float, ...] = ()
    itls_ms: tuple[float, ...] = ()  # every gap of every request, flattened
    e2els_ms: tuple[float, ...] = ()
    first_error: str | None = None

    def latency(self, metric: str) -> Latency:
        if metric not in METRICS:
            raise KeyError(metric)
        value: Latency = getattr(self, metric)
        return value


def _number(data: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, str) and value == "inf":
        return math.inf
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BenchError(f"vLLM result has no number at {key!r} (got {value!r})")
    return float(value)


def _latency(data: Mapping[str, Any], metric: str) -> Latency:
    return Latency(
        mean=_number(data, f"mean_{metric}_ms"),
        median=_number(data, f"median_{metric}_ms"),
        p90=_number(data, f"p90_{metric}_ms"),
        p99=_number(data, f"p99_{metric}_ms"),
    )


def parse_result(data: Mapping[str, Any], label: str | None = None) -> BenchResult:
    """A summary of one result mapping; BenchError names the first key that is missing or wrong."""
    completed = int(_number(data, "completed"))
    ttfts = data.get("ttfts") or []
    latencies = data.get("latencies") or []
    itls = data.get("itls") or []
    errors = [e for e in data.get("errors") or [] if e]
    # A failed request has ttft 0 and no ITLs; count only those that produced a first token.
    ok = [i for i, t in enumerate(ttfts) if isinstance(t, int | float) and t > 0]
    goodput = data.get("request_goodput")
    output_lens = [n for n in data.get("output_lens") or [] if isinstance(n, int) and n > 0]
    input_lens = data.get("input_lens") or []
    total_in = _number(data, "total_input_tokens", 0.0)
    total_out = _number(data, "total_output_tokens", 0.0)
    concurrency = data.get("max_concurrency")
    return BenchResult(
        label=label or str(data.get("label") or "run"),
        request_rate=_number(data, "request_rate", math.inf),
        max_concurrency=int(concurrency) if isinstance(concurrency, int) else None,
        completed=completed,
        failed=int(_number(data, "failed", 0.0)),
        duration_s=_number(data, "duration"),
        request_throughput=_number(data, "request_throughput"),
        output_throughput=_number(data, "output_throughput"),
        goodput=float(goodput) if isinstance(goodput, int | float) else None,
        mean_input_len=total_in / completed
        if completed
        else (sum(input_lens) / len(input_lens) if input_lens else 0.0),
        mean_output_len=total_out / completed
        if completed
        else (sum(output_lens) / len(output_lens) if output_lens else 0.0),
        ttft=_latency(data, "ttft"),
        tpot=_latency(data, "tpot"),
        itl=_latency(data, "itl"),
        e2el=_latency(data, "e2el"),
        ttfts_ms=tuple(ttfts[i] * 1000 for i in ok),
        itls_ms=tuple(x * 1000 for i in ok if i < len(itls) for x in itls[i]),
        e2els_ms=tuple(latencies[i] * 1000 for i in ok if i < len(latencies)),
        first_error=str(errors[0])[:300] if errors else None,
    )


def load_result(path: str | Path, label: str | None = None) -> BenchResult:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read vLLM's result file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise BenchError(f"vLLM's result file {path} does not hold a JSON object")
    return parse_result(data, label)
