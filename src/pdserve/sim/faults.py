"""Injected faults: what a sim instance does wrong on purpose, set by flags or ``POST /sim/faults``.

Each generation request draws once from the instance's seeded RNG to pick at most one request fault
(error, hang or drop); KV pulls draw separately. With the same seed and the same request order, the same
requests fail, so fault tests are deterministic.

- ``error_rate``: answered like vLLM's unexpected failures: 500 ``InternalServerError``.
- ``hang_rate``: never answered; the request waits until the client hangs up (then it is aborted).
- ``drop_rate``: the connection is closed mid-response: after half the tokens when streaming (after
  ``drop_after_tokens`` if set), after part of the body otherwise (the process "died" while answering).
- ``token_delay_s``: every token waits this much longer (a slow or overloaded instance).
- ``pull_fail_rate``: this instance's KV pulls fail, as a NIXL read error does; the decode request then
  fails like vLLM's (500, or 200 + an error event). The holder keeps the blocks until its lease runs out.
- ``logprob_noise``: every reported logprob moves by a uniform draw of up to this size (bf16-style noise).
- ``down``: every connection to the instance, ``/health`` included, is closed without an answer, as
  if the process were gone. ``/sim/*`` stays reachable so tests can bring it back.

Two faults are events rather than rates, so they are routes of their own (sim/api.py):
``POST /sim/stall`` stops the engine stepping for a while (SIGSTOP of vLLM's EngineCore: no heartbeats,
no lease reaping), ``POST /sim/restart`` kills the instance and brings it back under a new engine id.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError

_RATES = ("error_rate", "hang_rate", "drop_rate", "pull_fail_rate")


@dataclass(frozen=True)
class FaultSpec:
    error_rate: float = 0.0
    hang_rate: float = 0.0
    drop_rate: float = 0.0
    token_delay_s: float = 0.0
    pull_fail_rate: float = 0.0
    down: bool = False
    seed: int = 0
    # Not a fault but run-to-run noise: every reported logprob is moved by up to this much, as bf16
    # kernels whose reductions follow the batch's shape move them (the answer oracle must tolerate it).
    logprob_noise: float = 0.0
    drop_after_tokens: int = 0  # a dropped stream's tokens before the cut; 0: half of max_tokens

    def __post_init__(self) -> None:
        if isinstance(self.drop_after_tokens, bool) or not isinstance(self.drop_after_tokens, int):
            raise ConfigError(f"fault drop_after_tokens must be an integer, got {self.drop_after_tokens!r}")
        for name in (*_RATES, "token_delay_s", "logprob_noise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"fault {name} must be a number, got {value!r}")
            if value < 0 or (name in _RATES and value > 1):
                bound = "in [0, 1]" if name in _RATES else ">= 0"
                raise ConfigError(f"fault {name} must be {bound}, got {value}")
        if self.error_rate + self.hang_rate + self.drop_rate > 1:
            raise ConfigError("fault error_rate + hang_rate + drop_rate must be <= 1")
        if not isinstance(self.down, bool):
            raise ConfigError(f"fault down must be true or false, got {self.down!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"fault seed must be an integer, got {self.seed!r}")

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def updated(self, changes: dict[str, Any]) -> FaultSpec:
        """This spec with ``changes`` applied (unnamed fields keep their values); ConfigError if invalid."""
        unknown = set(changes) - _FIELDS
        if unknown:
            raise ConfigError(f"unknown fault fields {sorted(unknown)}; valid: {', '.join(sorted(_FIELDS))}")
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name for f in dataclasses.fields(FaultSpec)}


class RequestFault(enum.Enum):
    NONE = "none"
    ERROR = "error"
    HANG = "hang"
    DROP = "drop"


class Faults:
    """One instance's current fault spec and its RNG (reseeded whenever a spec is set)."""

    def __init__(self, spec: FaultSpec | None = None) -> None:
        self.spec = FaultSpec()
        self._rng = random.Random(0)
        self.set(spec or FaultSpec())

    def set(self, spec: FaultSpec) -> None:
        self.spec = spec
        self._rng = random.Random(spec.seed)

    def update(self, changes: dict[str, Any]) -> FaultSpec:
        self.set(self.spec.updated(changes))
        return self.spec

    @property
    def is_down(self) -> bool:
        return self.spec.down

    def draw_request_fault(self) -> RequestFault:
        spec = self.spec
        if not (spec.error_rate or spec.hang_rate or spec.drop_rate):
            return RequestFault.NONE
        r = self._rng.random()
        if r < spec.error_rate:
            return RequestFault.ERROR
        r -= spec.error_rate
        if r < spec.hang_rate:
            return RequestFault.HANG
        r -= spec.hang_rate
        return RequestFault.DROP if r < spec.drop_rate else RequestFault.NONE

    def draw_pull_failure(self) -> bool:
        rate = self.spec.pull_fail_rate
        return rate > 0 and self._rng.random() < rate
