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

A suspect answer is never relayed: the plan prefills again, under a fresh ``cache_salt``. vLLM puts the
blocks a pull filled into decode's prefix cache, so a late pull leaves wrong blocks there under the
prompt's hashes; ``purge`` empties that decode's prefix cache (``POST /reset_prefix_cache``, served by
vLLM in dev mode, which ``pdserve up`` turns on for decodes) so later requests with that prefix (the
next turn of the same chat) do not reuse them. An answer whose first byte beats the lease
cannot have read released blocks, so a stream that began in time is trusted to its end, unless prefill's
log later says otherwise (the flow checks again before the stream's last chunk).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import orjson

from pdserve import prometheus
from pdserve.errors import UpstreamError
from pdserve.proxy.kv.ledger import Handoff, Ledger
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.state import ProxyState

log = logging.getLogger("pdserve.proxy")

_SCRAPE_TIMEOUT_S = 2.0
# Without preempting running requests: vLLM's reset_running_requests=true preempts every running request
# and raises in the engine core when one is waiting for remote KV (v1/core/sched/scheduler.py), which a
# busy decode usually has. A plain reset is refused while requests hold blocks: counted as "refused".
_RESET_PATH = "/reset_prefix_cache"


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

    async def purge(self, decode: Instance) -> str:
        """Empty ``decode``'s prefix cache after it may have read released KV; the result, as counted
        (ok, refused, unavailable: vLLM not in dev mode, failed)."""
        try:
            reply = await decode.upstream.post(_RESET_PATH, b"", {}, "reset", _SCRAPE_TIMEOUT_S)
        except UpstreamError as exc:
            result, detail = "failed", exc.detail
        else:
            if reply.status == 200:
                is_done = _success(reply.body)
                result, detail = ("ok", "") if is_done else ("refused", "vLLM answered success=false")
            elif reply.status in (404, 405):
                result, detail = "unavailable", "start it with VLLM_SERVER_DEV_MODE=1 (pdserve up does)"
            else:
                result, detail = "failed", f"answered {reply.status}"
        self._state.stats.purged(result)
        if result == "ok":
            log.warning("decode %s: prefix cache reset after a late KV pull", decode.url)
        else:
            log.warning(
                "decode %s may keep wrong KV blocks in its prefix cache after a late pull; "
                "could not reset it: %s (%s)", decode.url, result, detail,
            )  # fmt: skip
        return result


def _success(body: bytes) -> bool:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return True  # an older vLLM answers 200 with no body
    return not isinstance(data, dict) or data.get("success", True) is not False
