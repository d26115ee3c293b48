"""Choosing an instance: policies behind one small interface, looked up by name in a registry.

Policies know nothing of HTTP: they get candidates (anything with a URL, an in-flight count and an
engine load) and return one, so they are unit-tested with plain objects.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdserve.errors import ConfigError


class Load(Protocol):
    @property
    def num_running(self) -> float: ...
    @property
    def num_waiting(self) -> float: ...
    @property
    def kv_usage(self) -> float: ...


class Candidate(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def num_in_flight(self) -> int: ...
    @property
    def load(self) -> Load: ...


C = TypeVar("C", bound=Candidate)


class Policy(Protocol):
    def choose(self, candidates: Sequence[C]) -> C: ...


def load_score(c: Candidate) -> float:
    """Requests ahead of a new one here. The proxy's in-flight count reacts at once; the engine's
    running + waiting (scraped every few seconds) also counts other clients' work. KV usage (0..1)
    breaks ties toward the instance with more free cache."""
    return max(float(c.num_in_flight), c.load.num_running + c.load.num_waiting) + c.load.kv_usage


def _require(candidates: Sequence[C]) -> None:
    if not candidates:
        raise LookupError("no instance to choose from")


class RoundRobin:
    """Each call takes the next candidate in turn; fair when instances are alike."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[C]) -> C:
        _require(candidates)
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded:
    """The candidate with the lowest load score; ties go round robin so equal instances share work."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[C]) -> C:
        _require(candidates)
        start = next(self._counter) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=load_score)


class PowerOfTwo:
    """Two candidates at random, the less loaded of them: near least-loaded balance without herding
    every proxy onto the same instance between two scrapes."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[C]) -> C:
        _require(candidates)
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        return min(candidates[a], candidates[b], key=load_score)


@dataclass(frozen=True)
class PolicyOptions:
    block_size: int = 16  # the engines' KV block size, for prompt-aware policies
    load_cost_tokens: float = 256.0  # prefix_aware: cached tokens worth one more request ahead


def _prefix_aware(options: PolicyOptions) -> Policy:
    from pdserve.proxy.prefix import PrefixAware  # prefix.py builds on this module

    return PrefixAware(options.block_size, options.load_cost_tokens)


POLICIES: dict[str, Callable[[PolicyOptions], Policy]] = {
    "round_robin": lambda _: RoundRobin(),
    "least_loaded": lambda _: LeastLoaded(),
    "power_of_two": lambda _: PowerOfTwo(),
    "prefix_aware": _prefix_aware,
}


def make_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None
    return factory(options or PolicyOptions())
