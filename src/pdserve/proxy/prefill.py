"""The prefill attempts of one request: the client's body rewritten to one token with
``do_remote_decode``, sent to a prefill instance; its ``kv_transfer_params`` come back to the flow
(``Prefilled``), which opens the handoff in the KV ledger.

A 5xx, a timeout or a broken connection moves on to another prefill instance, after a backoff, within
the request's deadline; vLLM's own 4xx is the client's mistake, which no other instance would answer
differently, so it is relayed at once. A prefill sent twice costs only compute: a stale keep-alive
connection is retried invisibly (``is_repeatable``).
"""

from __future__ import annotations

import time

import orjson

from pdserve import protocol
from pdserve.config import ProxyConfig
from pdserve.errors import NoInstanceAvailable, UpstreamError, UpstreamProtocolError, UpstreamTimeout
from pdserve.proxy.attempt import Call, Prefilled, PrefillFailed, Relayed, describe, relay_rejection
from pdserve.proxy.choice import Chooser
from pdserve.proxy.instance import Instance
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Reply


class Prefiller:
    def __init__(self, state: ProxyState, config: ProxyConfig, chooser: Chooser) -> None:
        self._state = state
        self._config = config
        self._chooser = chooser

    async def attempts(
        self, call: Call, first: Instance | None = None, avoid: Instance | None = None
    ) -> Prefilled | Relayed | PrefillFailed:
        """Prefill ``call`` on up to ``max_prefill_attempts`` distinct instances: ``first`` first if
        given (the elastic router's pick), never ``avoid`` (the decode of an elastic pool, which pulls
        from another instance, not from itself)."""
        payload = orjson.dumps(protocol.prefill_body(call.body))
        tried: list[Instance] = [] if avoid is None else [avoid]
        failure: UpstreamError | Reply | None = None
        for attempt in range(1, self._config.retries.max_prefill_attempts + 1):
            if attempt > 1:
                if not self._chooser.has_other("prefill", tried):
                    break  # a retry goes to another instance, and there is none
                self._state.stats.retried("prefill")
                await call.sleep(self._config.retries.backoff(attempt - 1))
            try:
                prefill = (
                    first if attempt == 1 and first is not None else self._chooser.prefill(tried, call.prompt)
                )
            except NoInstanceAvailable as exc:
                failure = exc  # none in service (e.g. the only one restarting): a fallback may still serve
                break
            tried.append(prefill)
            result = await self._attempt(call, prefill, payload)
            if not isinstance(result, UpstreamError | Reply):
                return result
            failure = result
            call.trace.retries.append(f"prefill {prefill.url}: {describe(failure)}")
            if time.monotonic() >= call.deadline:
                break
        assert failure is not None
        sent = [i for i in tried if i is not avoid]
        return PrefillFailed(failure, sent[-1].url if sent else "-")

    async def _attempt(
        self, call: Call, prefill: Instance, payload: bytes
    ) -> Prefilled | Relayed | UpstreamError | Reply:
        """One prefill call: the handoff, the relayed rejection, or why it failed (an error, a 5xx)."""
        trace = call.trace
        trace.prefill_url = prefill.url
        begun = time.perf_counter()
        try:
            limit = call.limit("prefill", prefill.url, self._config.timeouts.prefill)
            call.timeline.prefill_sent = time.perf_counter()
            with prefill.dispatched():
                reply = await prefill.upstream.post(
                    call.path, payload, call.headers, "prefill", limit, is_repeatable=True
                )
            call.timeline.prefill_done = time.perf_counter()
            trace.prefill_ms = (call.timeline.prefill_done - begun) * 1000
            trace.prefill_status = reply.status
            if reply.status == 200:
                try:
                    params = protocol.kv_params_from_prefill(reply.body)
                except ValueError as exc:
                    raise UpstreamProtocolError("prefill", prefill.url, str(exc)) from None
                prefill.succeeded()
                return Prefilled(prefill.url, params, prefill.num_kv_expired)
            if reply.status < 500:  # the client's own mistake: no other instance would differ
                prefill.succeeded()
                await relay_rejection("prefill", prefill.url, reply, call.out)
                return Relayed()
            prefill.failed(f"answered {reply.status}")
            return reply
        except UpstreamTimeout as exc:
            prefill.failed(exc.detail, is_slow=True)
            return call.timeout_cause(exc)
        except UpstreamError as exc:
            prefill.failed(exc.detail, is_slow=exc.is_slow)
            return exc
