"""Choosing an instance: policies behind one small interface, looked up by name in a registry.

Policies know nothing of HTTP: they get the candidates and return one. Richer policies (least loaded,
prefix-aware) plug in here with the same signature.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from pdserve.errors import ConfigError

T = TypeVar("T")


class Policy(Protocol):
    def choose(self, candidates: Sequence[T]) -> T: ...


class RoundRobin:
    """Each call takes the next candidate in turn; fair when instances are alike."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[T]) -> T:
        if not candidates:
            raise LookupError("no instance to choose from")
        return candidates[next(self._counter) % len(candidates)]


POLICIES: dict[str, Callable[[], Policy]] = {"round_robin": RoundRobin}


def make_policy(name: str) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None
    return factory()
