"""What the real-vLLM fault tests share: a stack's engine process group by role, a wait on a condition
that a supervisor or an engine makes true in its own time, and the push tests' requests and reads of what
an instance holds."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import requests

from pdserve.engines.backend import LocalEngines
from pdserve.errors import MetricsUnreadable
from pdserve.prometheus import KV_USAGE, NUM_RUNNING, NUM_WAITING, scrape
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


def model_name(stack: Stack) -> str:
    assert stack.model is not None
    return stack.model.served_model_name or stack.model.path


def tagged_prompt(tag: str) -> str:
    """A fresh ~60-token prompt, ``tag`` first."""
    return f"{tag} {uuid.uuid4().hex[:6]}: " + "the harbour lights came on one by one " * 7


def complete(base: str, model: str, prompt: str, request_id: str | None = None) -> requests.Response:
    """Eight greedy tokens of ``prompt`` from ``base`` (a proxy or an instance), whole."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    headers = {"X-Request-Id": request_id} if request_id else {}
    return requests.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)


def holdings(url: str) -> tuple[float, float, float] | None:
    """(KV usage, requests running, requests waiting) by the instance's own counters; None if it is down."""
    try:
        s = scrape(url)
    except MetricsUnreadable:
        return None
    return (s.get(KV_USAGE, 0.0), s.get(NUM_RUNNING, 0.0), s.get(NUM_WAITING, 0.0))


def kv_usage(url: str) -> float:
    """The instance's KV cache usage by its own counters; 0 if it is down."""
    found = holdings(url)
    return 0.0 if found is None else found[0]
