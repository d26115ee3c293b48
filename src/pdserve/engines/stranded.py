"""Push decodes holding KV blocks that no push will ever free, told by vLLM's own counters.

In push mode decode allocates a request's blocks and registers them with prefill; vLLM 0.32 frees them
only when prefill's WRITE arrives (docs/handover.md). Aborting decode's request does not help: the
scheduler delays freeing the blocks of a request still waiting for remote KV until that KV comes. When
prefill dies, or its request is aborted, after decode registered, the blocks stay until decode restarts.

So a push decode that sits idle (nothing running, nothing waiting) yet holds blocks, without a break
for longer than its registration watchdog (``push_registration_timeout``, which `pdserve up` sets to the
lease: vLLM has then given up on the push too), holds blocks only a restart gets back. Prefix-cached
blocks do not count: vLLM counts them free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

from pdserve.engines.placement import InstanceSpec
from pdserve.prometheus import KV_USAGE, NUM_RUNNING, NUM_WAITING

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


class StrandedWatch:
    """One push decode's counters, sampled now and then: since when it has sat idle holding blocks."""

    __slots__ = ("_since", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: float | None = None  # monotonic: the first of an unbroken run of idle, holding samples

    def sample(self, counters: Mapping[str, float] | None, now: float) -> bool:
        """Take one sample (None: the metrics did not answer); whether the decode holds blocks no push
        will free. A sample that breaks the run (work to do, nothing held, no answer) starts it over."""
        if counters is None or not _is_idle_holding(counters):
            self._since = None
            return False
        if self._since is None:
            self._since = now
        return now - self._since > self.timeout_s

    def reset(self) -> None:
        """The decode restarted: whatever it held is gone."""
        self._since = None


def _is_idle_holding(counters: Mapping[str, float]) -> bool:
    idle = counters.get(NUM_RUNNING, 0.0) == 0.0 and counters.get(NUM_WAITING, 0.0) == 0.0
    return idle and counters.get(KV_USAGE, 0.0) > 0.0
