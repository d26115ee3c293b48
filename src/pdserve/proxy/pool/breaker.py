"""A per-instance circuit breaker, fed by requests' own failures (health checks act through instance.py)."""

from __future__ import annotations

from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failures; after ``cooldown_s`` lets one trial request
    through (half-open); a success closes it, a failure opens it again."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 10.0) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.num_consecutive_failures = 0
        self._opened_at: float | None = None
        self._is_trial_out = False

    def state(self, now: float) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        return "half_open" if now - self._opened_at >= self.cooldown_s else "open"

    def allows(self, now: float) -> bool:
        if self._opened_at is None:  # closed: the common case, asked per instance per attempt
            return True
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self._is_trial_out)

    def on_dispatch(self, now: float) -> None:
        if self._opened_at is not None and self.state(now) == "half_open":
            self._is_trial_out = True

    def record_success(self) -> None:
        self.num_consecutive_failures = 0
        self._opened_at = None
        self._is_trial_out = False

    def record_failure(self, now: float) -> None:
        self.num_consecutive_failures += 1
        self._is_trial_out = False
        if self._opened_at is not None or self.num_consecutive_failures >= self.threshold:
            self._opened_at = now

    def reset(self) -> None:
        """Forget past failures: the instance behind it is a new process (restarted, re-added)."""
        self.record_success()
