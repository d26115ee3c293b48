"""Which instance takes the next attempt: the role's policy over the instances in service, less those
already tried, and the two rules the policy does not know.

- **Panic mode**: when every instance of a role is out of service (health checks, circuits), refusing
  everyone would turn a flap (a busy machine, one slow check) into an outage, so the instance likeliest
  to answer is tried anyway; its answer feeds its breaker as usual.
- **Lagging decodes**: a decode that has shown no sign of stepping for a third of the lease
  (``Instance.lag_s``: a stream still waiting for its first byte, or token counters that do not move
  while the proxy has requests there) sends no lease heartbeats, so a handoff sent there may outwait
  prefill's lease: it gets none while another decode can take it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from pdserve.config import ProxyConfig, Role
from pdserve.errors import NoInstanceAvailable
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.routing import Pick, Prompt
from pdserve.proxy.pool.state import ProxyState

log = logging.getLogger("pdserve.proxy")

_LAGGING_SHARE = 1 / 3


class Chooser:
    def __init__(self, state: ProxyState, config: ProxyConfig) -> None:
        self._state = state
        self._config = config
        self._lagging_s = config.kv_lease_s * _LAGGING_SHARE

    def decode(self, tried: Sequence[Instance], prompt: Prompt | None) -> tuple[Instance, int]:
        """A decode instance and how many of the prompt's tokens it likely holds in its prefix cache."""
        candidates = self._candidates("decode", tried)
        now = time.monotonic()
        stepping = [c for c in candidates if c.lag_s(now) < self._lagging_s]
        pick = self._pick("decode", stepping or candidates, prompt)
        return pick.instance, pick.num_cached_tokens

    def prefill(self, tried: Sequence[Instance], prompt: Prompt | None) -> Instance:
        return self._pick("prefill", self._candidates("prefill", tried), prompt).instance

    def stand_in(self, tried: Sequence[Instance], unavailable: NoInstanceAvailable) -> Instance:
        """No decode can take the request (``unavailable`` says why): a prefill instance in service
        serves it whole, as any vLLM instance can. None either: ``unavailable``, naming both roles."""
        candidates = self._state.pool("prefill").available(exclude=tried)
        if not self._config.retries.prefill_stands_in:
            raise unavailable
        if not candidates:
            raise NoInstanceAvailable(
                "decode", f"{unavailable.detail}; and no prefill instance can serve it whole"
            )
        self._state.stats.stood_in()
        return self._pick("prefill", candidates, None).instance

    def stand_in_for(self, decode: Instance, tried: Sequence[Instance]) -> Instance | None:
        """A fixed pool whose only decode (``decode``) failed before the client's first byte and could not
        compute the prompt itself: the prefill instance that takes the request whole, or None when
        none may."""
        if not self._config.retries.prefill_stands_in or not self._state.pool("prefill").available():
            return None
        return self.stand_in([*tried, decode], NoInstanceAvailable("decode", "-"))

    def elsewhere(
        self, tried: Sequence[Instance], holder_url: str | None, prompt: Prompt | None
    ) -> tuple[Instance, bool]:
        """An elastic pool's decode retry: another instance, and whether the handoff still in play (one
        the failed decode never read; its KV on ``holder_url``) goes there, which it does when that is
        not the instance holding the KV; otherwise the retry is served whole (the holder cannot pull
        from itself; the lease frees its blocks)."""
        holder = self._state.find(holder_url) if holder_url is not None else None
        if holder is not None and self.has_other("decode", [*tried, holder]):
            return self.decode([*tried, holder], prompt)[0], True
        return self.decode(tried, prompt)[0], False

    def members(self) -> list[Instance]:
        """The instances an elastic pool's router may place a request on: those in service, or panic
        mode's one when none is."""
        return self._candidates("decode", ())

    def _pick(self, role: Role, candidates: Sequence[Instance], prompt: Prompt | None) -> Pick[Instance]:
        return self._state.policy(role).pick(candidates, prompt.hashes if prompt is not None else None)

    def has_other(self, role: Role, tried: Sequence[Instance], also: Instance | None = None) -> bool:
        """Whether an instance in service is left for a retry that must go elsewhere (than ``tried``
        and ``also``)."""
        return self._state.pool(role).has_available(tried, also)

    def _candidates(self, role: Role, tried: Sequence[Instance]) -> list[Instance]:
        pool = self._state.pool(role)
        candidates = pool.available(exclude=tried)
        if candidates:
            return candidates
        now = time.monotonic()
        fallbacks = [i for i in pool.instances if i.is_panic_candidate and i not in tried]
        if fallbacks:
            best = min(fallbacks, key=lambda i: i.failure_score)
            self._state.stats.panicked(role)
            log.warning(
                "no %s instance in service; trying %s (%s)", role, best.url, best.why_unavailable(now)
            )
            return [best]
        states = ", ".join(f"{i.url} ({i.why_unavailable(now)})" for i in pool.instances)
        raise NoInstanceAvailable(role, states or "none configured")
