"""The KV lifecycle ledger: every handoff from prefill's answer until decode starts answering, or not.

A handoff opens when prefill returns ``kv_transfer_params`` (its blocks are now pinned under a lease)
and closes as *delivered* once decode's answer begins, or as *abandoned* (client gone, decode refused,
retries exhausted). What prefill then does with the blocks (docs/vllm-kv-lifecycle.md): a decode that
rejects the params in its handler notifies prefill, which frees them at once; an abandoned handoff that
decode never received waits for the lease (``kv_lease_duration``, 30 s unless `pdserve up --kv-lease`
says otherwise). So the ledger's job is to account: what was abandoned and why, and which open handoffs
are past their lease, the ones to worry about.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.events import KVLogEvent

HandoffState = Literal["open", "delivered", "abandoned"]


@dataclass
class Handoff:
    request_id: str  # the client's X-Request-Id
    prefill_url: str
    params: dict[str, Any]  # prefill's kv_transfer_params, verbatim
    received_at: float  # monotonic: the lease on prefill started about then
    lease_s: float
    state: HandoffState = "open"
    decode_url: str | None = None
    reason: str | None = None  # why it was abandoned
    # prefill's count of leases that ran out unpulled, as last scraped before this handoff opened
    prefill_expired_before: float | None = None
    suspect: str | None = None  # why its KV may have been released before decode read it

    @property
    def num_blocks(self) -> int:
        groups = self.params.get("remote_block_ids") or []
        return sum(len(g) for g in groups if isinstance(g, list))

    def age_s(self) -> float:
        return time.monotonic() - self.received_at

    @property
    def remote_request_id(self) -> str:
        return str(self.params.get("remote_request_id"))

    def is_past_lease(self, now: float) -> bool:
        """Whether prefill may have released the KV by ``now`` if no decode heartbeat extended it: the
        lease began before the proxy had the answer, so the proxy's clock is given a margin."""
        return now - self.received_at >= self.lease_s - lease_margin_s(self.lease_s)

    def is_fresh(self) -> bool:
        """Young enough to hand to another decode: half the lease leaves it time to start its pull."""
        return self.age_s() < self.lease_s / 2

    def describe(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "state": self.state,
            "prefill_url": self.prefill_url,
            "remote_engine_id": self.params.get("remote_engine_id"),
            "remote_request_id": self.params.get("remote_request_id"),
            "num_blocks": self.num_blocks,
            "age_s": round(self.age_s(), 3),
            "lease_s": self.lease_s,
            "decode_url": self.decode_url,
            "reason": self.reason,
            "suspect": self.suspect,
        }


def lease_margin_s(lease_s: float) -> float:
    """How much earlier than the proxy's clock says the lease may end: prefill starts it when its engine
    finishes, a little before its HTTP answer reaches the proxy."""
    return max(1.0, 0.1 * lease_s)


_NUM_LOG_EVENTS = 65536


class Ledger:
    def __init__(self, lease_s: float, num_recent: int = 256) -> None:
        self.lease_s = lease_s
        self._open: dict[int, Handoff] = {}
        self.recent: deque[Handoff] = deque(maxlen=num_recent)  # closed ones, newest last
        self.num_issued = 0
        self.num_delivered = 0
        self.abandoned: Counter[str] = Counter()  # by short reason
        self.suspects: Counter[str] = Counter()  # by kind: why a handoff's KV was not trusted
        # (prefill url, remote_request_id) → what prefill's log said of it, newest last
        self._log_events: OrderedDict[tuple[str, str], KVLogEvent] = OrderedDict()

    def open(
        self, request_id: str, prefill_url: str, params: dict[str, Any], prefill_expired: float | None = None
    ) -> Handoff:
        handoff = Handoff(request_id, prefill_url, params, time.monotonic(), self.lease_s)
        handoff.prefill_expired_before = prefill_expired
        self._open[id(handoff)] = handoff
        self.num_issued += 1
        return handoff

    def delivered(self, handoff: Handoff, decode_url: str) -> None:
        if self._close(handoff, "delivered"):
            handoff.decode_url = decode_url
            self.num_delivered += 1

    def abandon(self, handoff: Handoff, reason: str, kind: str) -> bool:
        """Close as abandoned; False if it was already closed. ``kind`` is the short label counted."""
        if not self._close(handoff, "abandoned"):
            return False
        handoff.reason = reason
        self.abandoned[kind] += 1
        return True

    def on_log_event(self, event: KVLogEvent) -> None:
        """Prefill's log said something about a handoff (see events.py); kept for the lease checks."""
        self._log_events[(event.url, event.remote_request_id)] = event
        while len(self._log_events) > _NUM_LOG_EVENTS:
            self._log_events.popitem(last=False)
        key = (event.url, event.remote_request_id)
        for handoff in self.recent:
            # Too late to retry: the answer went out. Counted, so /metrics shows it happened.
            is_it = (handoff.prefill_url, handoff.remote_request_id) == key
            if is_it and handoff.state == "delivered" and handoff.suspect is None:
                self.mark_suspect(handoff, "log_after_delivery", f"prefill log, after delivery: {event.kind}")

    def log_event(self, handoff: Handoff) -> KVLogEvent | None:
        """What prefill's log said about this handoff's KV, if anything."""
        if not self._log_events:  # nothing said (no launcher, or a quiet one): asked once a request
            return None
        return self._log_events.get((handoff.prefill_url, handoff.remote_request_id))

    def mark_suspect(self, handoff: Handoff, kind: str, why: str) -> None:
        """The handoff's KV may have been released before decode read it; ``kind`` is counted."""
        handoff.suspect = why
        self.suspects[kind] += 1
        if handoff.state != "open":
            return
        self.abandon(handoff, why, "suspect")

    def _close(self, handoff: Handoff, state: HandoffState) -> bool:
        if self._open.pop(id(handoff), None) is None:
            return False
        handoff.state = state
        self.recent.append(handoff)
        return True

    @property
    def open_handoffs(self) -> list[Handoff]:
        return list(self._open.values())

    def num_held_at(self, prefill_url: str) -> int:
        """Open handoffs from ``prefill_url``: KV it holds for a decode that has not pulled it yet. Each
        closes when decode answers or the request lets it go, so a drain that waits on this is bounded
        by the requests' own deadlines."""
        return sum(1 for h in self._open.values() if h.prefill_url == prefill_url)

    def num_overdue(self) -> int:
        """Open handoffs older than the lease: prefill has (or soon will) let their blocks go."""
        return sum(1 for h in self._open.values() if h.age_s() > h.lease_s)

    def snapshot(self) -> dict[str, Any]:
        return {
            "lease_s": self.lease_s,
            "issued": self.num_issued,
            "delivered": self.num_delivered,
            "abandoned": dict(self.abandoned),
            "suspect": dict(self.suspects),
            "open": [h.describe() for h in self._open.values()],
            "overdue": self.num_overdue(),
            "recent": [h.describe() for h in reversed(self.recent)],
        }
