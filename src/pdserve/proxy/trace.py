"""What happened to one request, as `pdserve demo` narrates it and GET /requests serves it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol import Endpoint
from pdserve.proxy.ledger import Handoff


@dataclass
class Trace:
    """What happened to one request: the walk-through `pdserve demo` prints and /requests serves."""

    request_id: str
    endpoint: Endpoint
    stream: bool
    started: float = field(default_factory=time.time)
    prefill_url: str | None = None
    prefill_status: int | None = None
    prefill_ms: float | None = None
    kv_transfer_params: dict[str, Any] | None = None
    local_prefill_reason: str | None = None  # set when the request was not split, and why
    decode_url: str | None = None
    decode_status: int | None = None
    total_ms: float | None = None
    error: str | None = None  # the error the client received, if any
    stream_error_event: bool = False  # decode streamed vLLM's own error event
    retries: list[str] = field(default_factory=list)  # each failed attempt that was retried, and why
    handoff: Handoff | None = None  # the KV handoff in play, if any (see ledger.py)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "handoff"}


def outcome(trace: Trace, status: int | None) -> str:
    """The label /metrics counts the request under."""
    if trace.error == "client disconnected":
        return "client_disconnected"
    if trace.stream_error_event or (status == 200 and trace.error is not None):
        return "stream_error"
    code = status or 0
    return "ok" if code == 200 else "client_error" if code < 500 else "error"
