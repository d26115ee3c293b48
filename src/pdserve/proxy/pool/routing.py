"""Choosing an instance: the one policy interface, and the policies that need only load.

Policies know nothing of HTTP: they get candidates (anything with a URL, an in-flight count and an
engine load) and, when they want it (``wants_prompt``), the prompt's KV block hashes; they return a
``Pick``. So they are unit-tested with plain objects. The registry of names is policies.py.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar


@dataclass(frozen=True)
class Load:
    """What routing reads of an engine's load, as its /metrics said at the last scrape (instance.py's
    ``EngineLoad`` adds what else the proxy reads there)."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1


@dataclass(frozen=True)
class Prompt:
    """What the proxy knows of a request's prompt, for prompt-aware routing and the skip rule."""

    num_tokens: int
    hashes: list[int]  # chained hashes of its full KV blocks (blocks.py)


class Candidate(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def num_in_flight(self) -> int: ...
    @property
    def load(self) -> Load: ...


C = TypeVar("C", bound=Candidate)


class Pick(NamedTuple, Generic[C]):
    """A policy's choice (a tuple: made twice per request, a frozen dataclass costs 4x as much)."""

    instance: C
    num_cached_tokens: int = 0  # the policy's estimate of the prompt's cache hit there, before this request


class Policy(Protocol):
    @property
    def wants_prompt(self) -> bool:
        """Whether the prompt's block hashes would change this policy's choice (tokenizing costs)."""
        ...

    def pick(self, candidates: Sequence[C], prompt: Sequence[int] | None = None) -> Pick[C]:
        """One of ``candidates``; LookupError when there are none. ``prompt``: its block hashes."""
        ...

    def forget(self, url: str) -> None:
        """What the policy remembers of the instance no longer holds (it restarted or left)."""
        ...

    def learn(self, url: str, prompt: Sequence[int]) -> None:
        """Another proxy worker sent a prompt with these block hashes to ``url`` (peers.py)."""
        ...


class LoadPolicy:
    """Base of the policies that route on load alone: no prompt wanted, nothing to forget."""

    wants_prompt = False

    def pick(self, candidates: Sequence[C], prompt: Sequence[int] | None = None) -> Pick[C]:
        if not candidates:
            raise LookupError("no instance to choose from")
        return Pick(self._choose(candidates))

    def forget(self, url: str) -> None:
        return None

    def learn(self, url: str, prompt: Sequence[int]) -> None:
        return None

    def _choose(self, candidates: Sequence[C]) -> C:
        raise NotImplementedError


def load_score(c: Candidate) -> float:
    """Requests ahead of a new one here. The proxy's in-flight count reacts at once; the engine's
    running + waiting (scraped every few seconds) also counts other clients' work. KV usage (0..1)
    breaks ties toward the instance with more free cache."""
    return max(float(c.num_in_flight), c.load.num_running + c.load.num_waiting) + c.load.kv_usage


class RoundRobin(LoadPolicy):
    """Each call takes the next candidate in turn; fair when instances are alike."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def _choose(self, candidates: Sequence[C]) -> C:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded(LoadPolicy):
    """The candidate with the lowest load score; ties go round robin so equal instances share work."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def _choose(self, candidates: Sequence[C]) -> C:
        start = next(self._counter) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=load_score)


class PowerOfTwo(LoadPolicy):
    """Two candidates at random, the less loaded of them: near least-loaded balance without herding
    every proxy onto the same instance between two scrapes."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def _choose(self, candidates: Sequence[C]) -> C:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        return min(candidates[a], candidates[b], key=load_score)
