"""`pdserve trace URL ID`: one request's timeline, from the proxy and, given their logs, the engines.

The proxy's part comes from its GET /requests: each phase in ms, the instances it used, retries, the KV
handoff (engine id, remote request id, blocks). The engines' part comes from the instance logs under a
run directory (`pdserve up` prints it): every line that names the request's id or its KV handoff's
remote request id, in time order, so vLLM's own account (received, transfer, lease) sits beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdserve import httpclient
from pdserve.errors import Unreachable, VerifyError

_PHASES = (
    ("queue_ms", "waited for an admission slot"),
    ("prefill_ms", "prefill call"),
    ("handoff_gap_ms", "between prefill's answer and decode's request"),
    ("decode_first_byte_ms", "decode until its first byte (KV pull included)"),
    ("ttft_ms", "arrival until the client's first byte"),
    ("itl_mean_ms", "mean gap between chunks"),
    ("itl_max_ms", "longest gap between chunks"),
    ("e2e_ms", "arrival until the client's last byte"),
)


def fetch(proxy_url: str, request_id: str, admin_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    url = f"{proxy_url.rstrip('/')}/requests?id={request_id}"
    try:
        response = httpclient.request(url, headers=headers, timeout=10)
    except Unreachable as exc:
        raise VerifyError(str(exc)) from exc
    if response.status != 200:
        raise VerifyError(f"{url} answered {response.status}: {response.body[:200]!r}")
    found = response.json().get("requests", [])
    if not found:
        raise VerifyError(f"the proxy has no record of request {request_id!r} (it keeps the last 256)")
    trace: dict[str, Any] = found[-1]
    return trace


def log_lines(run_dir: Path, needles: list[str]) -> Iterator[tuple[str, str]]:
    """(log file name, line) for each instance log line naming any of ``needles``."""
    for log in sorted(run_dir.glob("*.log")):
        with log.open("r", errors="replace") as lines:
            for line in lines:
                if any(n in line for n in needles):
                    yield log.stem, line.rstrip()


def render(trace: dict[str, Any], engine_lines: list[tuple[str, str]] | None = None) -> list[str]:
    out = [f"request {trace['request_id']}  {trace['endpoint']}{' (streamed)' if trace['stream'] else ''}"
           f"  outcome {trace.get('outcome')}  trace {trace.get('trace_id') or '-'}"]  # fmt: skip
    timeline = trace.get("timeline") or {}
    for key, what in _PHASES:
        if key in timeline:
            out.append(f"  {timeline[key]:10.1f} ms  {what}")
    out.append(f"  prefill {trace.get('prefill_url') or '-'} -> {trace.get('prefill_status')}   "
               f"decode {trace.get('decode_url') or '-'} -> {trace.get('decode_status')}")  # fmt: skip
    placement = trace.get("placement")
    if placement:
        where = (f"prefill {placement.get('prefill_url')}, decode {placement.get('decode_url')}"
                 if placement.get("split") else f"whole on {placement.get('decode_url')}")  # fmt: skip
        out.append(f"  elastic pool ({placement.get('layout')}): {where}: {placement.get('reason')}")
    if trace.get("local_prefill_reason"):
        out.append(f"  not split: {trace['local_prefill_reason']}")
    params = trace.get("kv_transfer_params") or {}
    if params:
        out.append(f"  KV handoff: engine {params.get('remote_engine_id')}, request "
                   f"{params.get('remote_request_id')}, blocks {params.get('remote_block_ids')}")  # fmt: skip
    for retry in trace.get("retries") or []:
        out.append(f"  retried: {retry}")
    if trace.get("error"):
        out.append(f"  error: {trace['error']}")
    if engine_lines is not None:
        out.append("  engines' logs:" if engine_lines else "  engines' logs: no line names this request")
        out.extend(f"    [{name}] {line}" for name, line in engine_lines)
    return out


def trace_request(proxy_url: str, request_id: str, run_dir: str | None, admin_key: str | None) -> list[str]:
    trace = fetch(proxy_url, request_id, admin_key)
    if run_dir is None:
        return render(trace)
    needles = [request_id]
    remote = (trace.get("kv_transfer_params") or {}).get("remote_request_id")
    if remote:
        needles.append(str(remote))
    return render(trace, list(log_lines(Path(run_dir), needles)))
