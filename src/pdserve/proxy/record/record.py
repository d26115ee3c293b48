"""What happened to one request, as `pdserve demo` narrates it and GET /requests serves it.

A record only: written as the request goes by its plan (request/plan.py), the one writer, from what each
step reported, and never read to decide anything."""

from __future__ import annotations

import time
from typing import Any

from pdserve.protocol import Endpoint
from pdserve.proxy.record.timeline import Timeline


class Trace:
    """What happened to one request: the walk-through `pdserve demo` prints and /requests serves.

    Made for every request: its constructor sets what every request has, and each other field reads as
    the class's default until the request's path writes it."""

    prefill_url: str | None = None
    prefill_status: int | None = None
    prefill_ms: float | None = None
    kv_transfer_params: dict[str, Any] | None = None
    local_prefill_reason: str | None = None  # set when the request was not split, and why
    # an elastic pool's decision: layout, split, prefill_url, decode_url, reason (proxy/pool/elastic.py)
    placement: dict[str, Any] | None = None
    # the wait at the proxy for its decode to have room for the KV (proxy/pool/backpressure.py): ms, why
    decode_wait: dict[str, Any] | None = None
    decode_url: str | None = None
    # the hand-over's sequence (request/handover.py): "pull", "push" (serial: prefill's identity not yet
    # known), "push concurrent"; "+ first token at once" when the client had prefill's token first
    handover: str | None = None
    decode_status: int | None = None
    total_ms: float | None = None
    error: str | None = None  # the error the client received, if any
    stream_error_event: bool = False  # decode streamed vLLM's own error event
    # each time the stream went on from another instance after its decode failed (migrate.py, through
    # ``migrated``): a tuple shared by every request until the first
    migrations: tuple[dict[str, Any], ...] = ()
    outcome: str | None = None  # the label /metrics counted the request under (state.Outcome)
    timeline: Timeline | None = None  # its moments; /requests shows each phase in ms (timeline.py)
    trace_id: str | None = None  # the OpenTelemetry trace, when tracing is on

    def __init__(self, request_id: str, endpoint: Endpoint, stream: bool) -> None:
        self.request_id = request_id
        self.endpoint = endpoint
        self.stream = stream
        self.started = time.time()
        self.retries: list[str] = []  # each failed attempt, and why

    def migrated(self, entry: dict[str, Any]) -> None:
        self.migrations = (*self.migrations, entry)

    def as_dict(self) -> dict[str, Any]:
        # The phases in ms only when asked for: the request path stores the Timeline as it is.
        out = {name: getattr(self, name) for name in _FIELDS}
        out["timeline"] = self.timeline.as_ms() if self.timeline is not None else {}
        return out


# What /requests shows of a trace, in this order.
_FIELDS = ("request_id", "endpoint", "stream", "started", "prefill_url", "prefill_status", "prefill_ms",
           "kv_transfer_params", "local_prefill_reason", "placement", "decode_wait", "decode_url", "handover",
           "decode_status", "total_ms", "error", "stream_error_event", "retries", "migrations", "outcome", "timeline", "trace_id")  # fmt: skip
