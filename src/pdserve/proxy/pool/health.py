"""Active health checks: every instance's ``/health`` decides its health, its ``/metrics`` its load.

The checker only observes and reports to ``ProxyState``, which moves the instance's lifecycle. It runs
on its own schedule; nothing that reads state (GET /health, /instances) triggers a check.
"""

from __future__ import annotations

import asyncio
import contextlib

from pdserve.errors import UpstreamConnectError, UpstreamError
from pdserve.proxy.pool.instance import EngineLoad, Instance
from pdserve.proxy.pool.state import ProxyState


class HealthChecker:
    def __init__(self, state: ProxyState, interval_s: float, timeout_s: float) -> None:
        self._state = state
        self._interval_s = interval_s
        self._timeout_s = timeout_s

    async def check(self, instance: Instance) -> None:
        """One check: /health decides health; /metrics, when it answers, refreshes load."""
        unreachable = False
        try:
            reply = await instance.upstream.get("/health", "health", self._timeout_s)
            error = None if reply.status == 200 else f"/health answered {reply.status}"
        except UpstreamError as exc:
            error, unreachable = exc.detail, isinstance(exc, UpstreamConnectError)
        if error is not None:
            self._state.check_failed(instance, error, unreachable)
            return
        load = None
        with contextlib.suppress(UpstreamError):
            metrics = await instance.upstream.get("/metrics", "metrics", self._timeout_s)
            if metrics.status == 200:
                load = EngineLoad.from_metrics(metrics.body.decode("utf-8", "replace"))
        self._state.check_passed(instance, load)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self._state.instances))

    async def run(self) -> None:
        """Check every instance at once, then every ``interval_s`` until cancelled: the first requests
        already find each engine's load, and prefill's lease counter that the lease guard compares
        against (kv/guard.py: without it, any answer past the lease is suspect)."""
        while True:
            await self.check_all()
            await asyncio.sleep(self._interval_s)
