"""Push decodes holding KV blocks that no push will ever free, told by vLLM's own counters.

In push mode decode allocates a request's blocks and registers them with prefill; vLLM 0.32 frees them
only when prefill's WRITE arrives (docs/handover.md). Aborting decode's request does not help: the
scheduler delays freeing the blocks of a request still waiting for remote KV until that KV comes. When
prefill dies, or its request is aborted, after decode registered, the blocks stay until decode restarts.

So a push decode that sits idle (nothing running, nothing waiting) yet holds blocks, without a break
for longer than its registration watchdog (``push_registration_timeout``, which `pdserve up` sets to the
lease: vLLM has then given up on the push too), holds blocks only a restart gets back. Prefix-cached
blocks do not count: vLLM counts them free.

A push whose prefill died may also stay *waiting* at decode for good (vLLM defers it, "KV fetch in
progress", holding its blocks). Deferred requests count as idle only when the proxy has nothing in
flight at that decode: while it has, a deferred request may be a push still on its way (within the
proxy's prefill timeout), and a restart would fail it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from pdserve.engines.placement import InstanceSpec
from pdserve.prometheus import (
    KV_USAGE,
    NUM_RUNNING,
    NUM_WAITING,
    WAITING_BY_REASON,
    parse_prometheus,
    sum_labelled,
)

_PUSH_CONNECTOR: Final = "NixlPushConnector"
_VLLM_REGISTRATION_TIMEOUT_S: Final = 480.0  # vLLM's decoder_kv_blocks_ttl, push's watchdog by default


def push_registration_timeout(spec: InstanceSpec) -> float | None:
    """The push decode's registration watchdog in seconds; None for any other instance."""
    if spec.role != "decode" or "--kv-transfer-config" not in spec.args:
        return None
    at = spec.args.index("--kv-transfer-config") + 1
    try:
        config = json.loads(spec.args[at])
    except (IndexError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("kv_connector") != _PUSH_CONNECTOR:
        return None
    extra = config.get("kv_connector_extra_config") or {}
    return float(extra.get("push_registration_timeout", _VLLM_REGISTRATION_TIMEOUT_S))


InFlight = Callable[[str], int | None]  # requests the proxy has in flight at an instance URL; None: unknown


@dataclass(frozen=True)
class DecodeLoad:
    """What the watch reads of a push decode's ``/metrics``."""

    running: float
    waiting: float  # deferred ones included, as vLLM counts them
    deferred: float  # 0 where vLLM does not say
    kv_usage: float

    @classmethod
    def parse(cls, text: str) -> DecodeLoad:
        totals = parse_prometheus(text)
        deferred = sum_labelled(text, WAITING_BY_REASON, reason="deferred")
        return cls(
            totals.get(NUM_RUNNING, 0.0), totals.get(NUM_WAITING, 0.0), deferred, totals.get(KV_USAGE, 0.0)
        )

    def is_idle_holding(self, proxy_in_flight: Callable[[], int | None]) -> bool:
        """Nothing to do, yet blocks held. ``proxy_in_flight`` is asked only when all that waits is
        deferred: those are orphans only if the proxy awaits nothing there."""
        if self.running or self.kv_usage <= 0.0:
            return False
        if not self.waiting:
            return True
        return self.waiting <= self.deferred and proxy_in_flight() == 0


class StrandedWatch:
    """One push decode's counters, sampled now and then: since when it has sat idle holding blocks."""

    __slots__ = ("_since", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: float | None = None  # monotonic: the first of an unbroken run of idle, holding samples

    def sample(
        self, load: DecodeLoad | None, now: float, proxy_in_flight: Callable[[], int | None] = lambda: None
    ) -> bool:
        """Take one sample (None: the metrics did not answer); whether the decode holds blocks no push
        will free. A sample that breaks the run (work to do, nothing held, no answer) starts it over."""
        if load is None or not load.is_idle_holding(proxy_in_flight):
            self._since = None
            return False
        if self._since is None:
            self._since = now
        return now - self._since > self.timeout_s

    def reset(self) -> None:
        """The decode restarted: whatever it held is gone."""
        self._since = None
