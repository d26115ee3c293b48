"""The prefill call: the client's body rewritten to one token with ``do_remote_decode``, sent to the
instance the plan named; its ``kv_transfer_params`` come back to the plan (``Prefilled``), which opens
the handoff in the KV ledger and decides what follows a failure.

vLLM's own 4xx is the client's mistake, which no other instance would answer differently, so it is
relayed at once (``Relayed``). A prefill sent twice costs only compute: a stale keep-alive connection is
retried invisibly (``is_repeatable``).
"""

from __future__ import annotations

from pdserve import protocol
from pdserve.config import Timeouts
from pdserve.errors import UpstreamError, UpstreamProtocolError, UpstreamTimeout
from pdserve.proxy.request.steps import Prefilled, PrefillStep, Relayed, relay_rejection
from pdserve.proxy.wire.upstream import Reply


class Prefiller:
    def __init__(self, timeouts: Timeouts) -> None:
        self._limit_s = timeouts.prefill

    async def attempt(self, step: PrefillStep) -> Prefilled | Relayed | UpstreamError | Reply:
        """One prefill call: the handoff, the relayed rejection, or why it failed (an error, a 5xx)."""
        call, prefill = step.call, step.instance
        try:
            limit = call.limit("prefill", prefill.url, self._limit_s)
            prefill.dispatch()
            try:
                reply = await prefill.upstream.post(
                    call.path, step.payload, call.headers, "prefill", limit, is_repeatable=True
                )
            finally:
                prefill.undispatch()
            if reply.status == 200:
                try:
                    answer = protocol.prefill_answer(reply.body)
                except ValueError as exc:
                    raise UpstreamProtocolError("prefill", prefill.url, str(exc)) from None
                prefill.succeeded()
                return Prefilled(prefill.url, answer["kv_transfer_params"], prefill.num_kv_expired, answer)
            if reply.status < 500:  # the client's own mistake: no other instance would differ
                prefill.succeeded()
                await relay_rejection("prefill", prefill.url, reply, call.out)
                return Relayed(reply.status)
            prefill.failed(f"answered {reply.status}")
            return reply
        except UpstreamTimeout as exc:
            prefill.failed(exc.detail, is_slow=True)
            return call.timeout_cause(exc)
        except UpstreamError as exc:
            prefill.failed(exc.detail, is_slow=exc.is_slow)
            return exc
