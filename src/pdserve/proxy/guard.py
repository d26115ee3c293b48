"""Whether decode's answer may rest on KV that prefill had already released (the lease guard).

vLLM's decode cannot tell: a read of released blocks "succeeds", is counted as a transfer, and the answer
is a 200 with whatever the blocks now hold (docs/vllm-kv-lifecycle.md, section 2). What the proxy can
use, checked when decode's first byte arrives (streamed) or its whole answer (not streamed), before the
client has any of it:

1. prefill's log (when pdserve launched it): "Releasing expired KV blocks for request <id> ... 0 remote
   worker(s)" or "Potentially invalid KV blocks for unrecognized request <id>" — definitive;
2. the proxy's own clock: an answer that begins before the lease can have run out read live blocks;
3. past that point, prefill's ``vllm:nixl_num_kv_expired_reqs_total``: if it did not move since the
   handoff opened, no lease ran out there, whatever decode's queueing (its heartbeats kept it alive).

A suspect answer is never relayed: the flow prefills again. An answer whose first byte beats the lease
cannot have read released blocks, so a stream that began in time is trusted to its end, unless prefill's
log later says otherwise (the flow checks again before the stream's last chunk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve import prometheus
from pdserve.errors import UpstreamError
from pdserve.proxy.ledger import Handoff, Ledger
from pdserve.proxy.state import ProxyState

_SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Suspicion:
    kind: str  # "log" (prefill's log said so) or "late" (past the lease, prefill's counter moved)
    why: str


class LeaseGuard:
    def __init__(self, state: ProxyState, ledger: Ledger) -> None:
        self._state = state
        self._ledger = ledger

    def from_log(self, handoff: Handoff) -> str | None:
        """Why prefill's log says the KV was gone, or None."""
        event = self._ledger.log_event(handoff)
        if event is None:
            return None
        if event.kind == "expired":
            return f"prefill {handoff.prefill_url} released the KV when its {handoff.lease_s:g} s lease ran out, before decode read it"
        return f"prefill {handoff.prefill_url} saw decode read KV it had already released"

    async def check(self, handoff: Handoff) -> Suspicion | None:
        """Why this handoff's KV may have been released before decode read it, or None when it was not.

        Call it when decode's answer begins; it scrapes prefill only for handoffs past the lease.
        """
        why = self.from_log(handoff)
        if why is not None:
            return Suspicion("log", why)
        now = time.monotonic()
        if not handoff.is_past_lease(now):
            return None
        age = now - handoff.received_at
        late = f"decode answered {age:.1f} s after prefill, past the {handoff.lease_s:g} s KV lease"
        before = handoff.prefill_expired_before
        expired_now = await self._expired_count(handoff.prefill_url)
        if before is None or expired_now is None:
            return Suspicion("late", f"{late}, and prefill's lease counter cannot be read")
        if expired_now > before:
            return Suspicion(
                "late", f"{late}, and prefill released {expired_now - before:g} expired lease(s) meanwhile"
            )
        return None

    async def _expired_count(self, prefill_url: str) -> float | None:
        instance = self._state.find(prefill_url)
        if instance is None:
            return None
        try:
            reply = await instance.upstream.get("/metrics", "metrics", _SCRAPE_TIMEOUT_S)
        except UpstreamError:
            return None
        if reply.status != 200:
            return None
        samples = prometheus.parse_prometheus(reply.body.decode("utf-8", "replace"))
        return samples.get(prometheus.KV_EXPIRED, 0.0)
