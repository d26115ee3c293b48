"""What the real-vLLM fault tests share: a stack's engine process group by role, and a wait on a condition
that a supervisor or an engine makes true in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.engines.backend import LocalEngines
from pdserve.stack import Stack


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def pgid(stack: Stack, role: str) -> int:
    """The process group of ``role``'s first instance (a signal to it reaches vLLM's workers too)."""
    assert isinstance(stack.engines, LocalEngines)
    spec = next(s for s in stack.specs if s.role == role)
    pid = stack.engines.group.pid(spec)
    assert pid is not None
    return pid
