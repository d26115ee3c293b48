"""Service-level objectives: per-request TTFT, TPOT and end-to-end bounds in milliseconds, in vLLM's
``--goodput`` syntax; what `bench` scores goodput against and the elastic pool's router plans for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from pdserve.errors import ConfigError

_SLO_NAMES: Final = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives in milliseconds (vLLM's ``--goodput``); None: not judged."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in _SLO_NAMES:
            value = getattr(self, f"{name}_ms")
            if value is not None and not value > 0:
                raise ConfigError(f"SLO {name} must be > 0 ms, got {value}")

    @property
    def is_set(self) -> bool:
        return any(getattr(self, f"{n}_ms") is not None for n in _SLO_NAMES)

    @classmethod
    def parse(cls, pairs: Sequence[str], flag: str = "--goodput") -> Slo:
        """vLLM's syntax: ``["ttft:200", "tpot:50"]`` (milliseconds); errors name ``flag``."""
        values: dict[str, float] = {}
        for pair in pairs:
            name, sep, value = pair.partition(":")
            if not sep or name not in _SLO_NAMES:
                raise ConfigError(
                    f"{flag} takes KEY:MS with KEY one of {', '.join(_SLO_NAMES)}, got {pair!r}"
                )
            try:
                values[f"{name}_ms"] = float(value)
            except ValueError:
                raise ConfigError(f"{flag} {pair!r}: {value!r} is not a number of ms") from None
        return cls(**values)

    def goodput_args(self) -> list[str]:
        pairs = [
            f"{n}:{getattr(self, f'{n}_ms'):g}" for n in _SLO_NAMES if getattr(self, f"{n}_ms") is not None
        ]
        return ["--goodput", *pairs] if pairs else []

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        """Whether a request with this TTFT and TPOT (seconds) meets the TTFT and TPOT objectives."""
        return (self.ttft_ms is None or ttft_s * 1000 <= self.ttft_ms) and (
            self.tpot_ms is None or tpot_s * 1000 <= self.tpot_ms
        )

    def describe(self) -> str:
        parts = [
            f"{n.upper()} ≤ {getattr(self, f'{n}_ms'):g} ms" for n in _SLO_NAMES if getattr(self, f"{n}_ms")
        ]
        return ", ".join(parts) or "none"
