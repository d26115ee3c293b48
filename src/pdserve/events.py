"""What the launcher learns about instances and tells the proxy: plain messages, so ``engines/`` and
``proxy/`` share a vocabulary without importing each other (stack.py carries them across).

- ``InstanceEvent``: the supervisor saw an instance exit, is restarting it, has it back, or gave up; or
  Ray restarted it on another node (``moved``, to ``new_url``).
- ``KVLogEvent``: a prefill instance's log said a handoff's lease expired unpulled, or that a decode read
  blocks it had already released (docs/vllm-kv-lifecycle.md, section 6).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

InstanceEventKind = Literal["exited", "restarting", "ready", "gave_up", "moved"]
KVLogEventKind = Literal["expired", "late_pull"]
_INSTANCE_KINDS = get_args(InstanceEventKind)
_KV_LOG_KINDS = get_args(KVLogEventKind)


@dataclass(frozen=True)
class InstanceEvent:
    url: str  # the instance's HTTP URL, as the proxy knows it
    kind: InstanceEventKind
    detail: str = ""  # exit status, restart count, why it gave up
    new_url: str = ""  # where it serves now ("moved" only)


@dataclass(frozen=True)
class KVLogEvent:
    url: str  # the prefill instance whose log said it
    kind: KVLogEventKind
    remote_request_id: str  # as in prefill's kv_transfer_params
    at: float  # time.monotonic() when the line was read


# The prefill log lines behind KVLogEvent, as vLLM 0.32 writes them (nixl/base_worker.py,
# nixl/pull_worker.py); the request id is the handoff's remote_request_id.
EXPIRED_LINE = "Releasing expired KV blocks for request "
LATE_PULL_LINE = "Potentially invalid KV blocks for unrecognized request "


def to_dict(event: InstanceEvent | KVLogEvent) -> dict[str, object]:
    """An event as JSON takes it, for a proxy in another process (proxy/serving/workers.py)."""
    kind = "instance" if isinstance(event, InstanceEvent) else "kv_log"
    return {"type": kind, **dataclasses.asdict(event)}


def from_dict(data: dict[str, Any]) -> InstanceEvent | KVLogEvent:
    """The event ``to_dict`` made; ValueError when ``data`` is not one."""
    fields = {k: v for k, v in data.items() if k != "type"}
    try:
        if data.get("type") == "instance" and fields.get("kind") in _INSTANCE_KINDS:
            return InstanceEvent(**fields)
        if data.get("type") == "kv_log" and fields.get("kind") in _KV_LOG_KINDS:
            return KVLogEvent(**fields)
    except TypeError as exc:
        raise ValueError(f"not an event: {exc}") from None
    raise ValueError(f"not an event: {data!r}")
