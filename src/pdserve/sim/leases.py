"""Both ends of vLLM 0.32's KV lease protocol (NixlConnector, pull mode) as plain bookkeeping; the engine
(engine.py) runs it from its step loop (docs/vllm-kv-lifecycle.md, sections 1 and 2).

- The holder (prefill) gets notifications from decodes and reads them only at its next step, before it
  reaps expired leases: a read is done (the hold is released), or came after the hold was gone (vLLM's
  "Potentially invalid KV blocks" line, ``nixl_num_notifications_after_expiry``); a heartbeat extends a
  hold to 2/3 of a lease from when it is read.
- The reader (decode) heartbeats every request it has received and not yet pulled, at most every
  lease // 6 s and only when its engine steps: a stalled engine sends none.

vLLM reads ``kv_lease_duration`` as an int: the interval is ``lease // 6`` (0 below 6 s: every step),
the extension ``lease * 2 // 3`` (nixl/base_scheduler.py, nixl/base_worker.py).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from pdserve.sim.scheduler import Scheduler
from pdserve.sim.types import RemoteKV

Notification = tuple[Literal["read", "heartbeat"], tuple[str, ...]]
Heartbeat = tuple[str, str, int, tuple[str, ...]]  # (holder's engine id, host, port, its request ids)


class HolderLeases:
    """A prefill engine's inbox of decode notifications."""

    def __init__(self, lease_s: float) -> None:
        self.extension_s = lease_s * 2 // 3
        self._inbox: deque[Notification] = deque()
        self.num_late_reads = 0  # vllm:nixl_num_notifications_after_expiry

    def notify(self, notification: Notification) -> None:
        self._inbox.append(notification)

    @property
    def has_mail(self) -> bool:
        return bool(self._inbox)

    def read(self, scheduler: Scheduler, now: float) -> list[str]:
        """Handle every notification at a step, as vLLM's worker does; the ids of reads that came after
        their hold was gone (their reader got someone else's blocks)."""
        late = []
        while self._inbox:
            kind, request_ids = self._inbox.popleft()
            if kind == "heartbeat":
                scheduler.extend_held(request_ids, now + self.extension_s)
                continue
            for request_id in request_ids:
                if scheduler.release_held(request_id) is None:
                    late.append(request_id)
        self.num_late_reads += len(late)
        return late


class ReaderLeases:
    """The remote holds a decode engine keeps alive: requests received, not yet pulled."""

    def __init__(self, lease_s: float) -> None:
        self.interval_s = lease_s // 6
        self._pending: dict[str, RemoteKV] = {}
        self._last_sent = -math.inf

    def add(self, request_id: str, remote: RemoteKV) -> None:
        self._pending[request_id] = remote

    def done(self, request_id: str) -> None:
        """The pull ended (or the request did): vLLM stops heartbeating it."""
        self._pending.pop(request_id, None)

    @property
    def is_empty(self) -> bool:
        return not self._pending

    def due(self, now: float) -> list[Heartbeat]:
        """The heartbeats to send at a step at ``now``, one per holder; none if sent too recently."""
        if not self._pending or now - self._last_sent < self.interval_s:
            return []
        self._last_sent = now
        by_holder: dict[str, list[RemoteKV]] = {}
        for remote in self._pending.values():
            by_holder.setdefault(remote.engine_id, []).append(remote)
        return [
            (engine_id, remotes[0].host, remotes[0].port, tuple(r.request_id for r in remotes))
            for engine_id, remotes in by_holder.items()
        ]

    def next_due(self, min_interval_s: float) -> float | None:
        """When an idle engine should step again to heartbeat, or None with nothing to keep alive."""
        if not self._pending:
            return None
        return self._last_sent + max(self.interval_s, min_interval_s)
