"""A returning instance meets its peers through the proxy's canary handoff before it takes a request; that
canary is a real transfer on decode. A test that counts decode's transfers after a restart first waits for
the canary, or it counts the canary as its own request's."""

from __future__ import annotations

import time

from pdserve.prometheus import parse_samples, scrape_text
from pdserve.stack import Stack


def warmups(stack: Stack) -> dict[str, float]:
    """``pdserve_warmups_total`` by result, as the proxy's /metrics counts them."""
    samples = parse_samples(scrape_text(stack.proxy_url))
    return {s.labels["result"]: s.value for s in samples if s.name == "pdserve_warmups_total"}


def wait_warmed_up(stack: Stack, before: dict[str, float], timeout: float = 60.0) -> None:
    """One more warm-up than ``before`` counted, and it met every peer."""
    deadline = time.monotonic() + timeout
    now = before
    while time.monotonic() < deadline:
        now = warmups(stack)
        if sum(now.values()) > sum(before.values()):
            break
        time.sleep(0.5)
    assert now.get("failed", 0.0) == before.get("failed", 0.0), f"a warm-up failed: {now}"
    assert now.get("ok", 0.0) > before.get("ok", 0.0), f"no warm-up within {timeout:.0f} s: {now}"
