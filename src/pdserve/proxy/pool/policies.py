"""The registry of routing policies by name (``--prefill-policy``, ``--decode-policy``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import ConfigError
from pdserve.proxy.pool.prefix import PrefixAware
from pdserve.proxy.pool.routing import LeastLoaded, Policy, PowerOfTwo, RoundRobin


@dataclass(frozen=True)
class PolicyOptions:
    block_size: int = 16  # the engines' KV block size, for prompt-aware policies
    load_cost_tokens: float = 256.0  # prefix_aware: cached tokens worth one more request ahead


POLICIES: dict[str, Callable[[PolicyOptions], Policy]] = {
    "round_robin": lambda _: RoundRobin(),
    "least_loaded": lambda _: LeastLoaded(),
    "power_of_two": lambda _: PowerOfTwo(),
    "prefix_aware": lambda o: PrefixAware(o.block_size, o.load_cost_tokens),
}


def make_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None
    return factory(options or PolicyOptions())
