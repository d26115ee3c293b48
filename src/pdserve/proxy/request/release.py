"""Giving prefill's blocks back when decode refused the request that was to pull them.

vLLM frees a handoff's blocks on prefill when a decode has read them (or when the lease runs out, 30 s
under ``up``). A decode that refuses the request in its API server (a 400 from validation) never gets
as far as its KV connector, so nothing tells prefill: the blocks stay pinned for the whole lease. The
checks before prefill (validation.py) leave few such refusals; for the rest (a rule the proxy does not
model) the refusing decode is sent the body prefill itself accepted (``prefill_body``: one token, not
streamed) with prefill's params. Decode takes it as prefill did, pulls the blocks and computes one
token; its notification to prefill frees them at once. The answer is dropped. It runs beside the
client's request, which already has its answer, and is counted by result in ``Stats.released``.

Under a fresh ``cache_salt``: had decode's refusal already freed the blocks on prefill (an engine that
rejects the params tells prefill), the pull would read whatever is there now, and decode would keep
those blocks in its prefix cache under the prompt's hashes; salted, they match no other request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import orjson

from pdserve import protocol
from pdserve.errors import UpstreamError
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.request.steps import Release

log = logging.getLogger("pdserve.proxy")


class Releaser:
    def __init__(self, state: ProxyState, timeout_s: float) -> None:
        self._state = state
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()  # held until done: the loop keeps weak refs only

    def release(self, step: Release) -> None:
        """Have the step's decode pull its handoff's blocks and drop the answer, in the background."""
        task = asyncio.get_running_loop().create_task(self._release(step))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, step: Release) -> None:
        call, decode, handoff = step
        salt = f"release-{uuid.uuid4().hex[:16]}"
        body = protocol.prefill_body(protocol.with_fresh_cache_salt(call.body, salt))
        body["kv_transfer_params"] = handoff.params
        headers = {**call.headers, "X-Request-Id": f"{call.request_id}-release"}
        try:
            reply = await decode.upstream.post(
                call.path, orjson.dumps(body), headers, "decode", self._timeout_s
            )
        except UpstreamError as exc:
            result, detail = "failed", exc.detail
        else:
            result = "ok" if reply.status == 200 else "refused"
            detail = f"answered {reply.status}"
        self._state.stats.released(result)
        log.info("request %s: decode %s refused it after prefill %s; release of prefill's blocks: %s (%s)",
                 call.request_id, decode.url, handoff.prefill_url, result, detail)  # fmt: skip
