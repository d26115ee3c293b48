"""Decode's engine stalled (SIGSTOP) past prefill's lease while a request waits on it: the case where a
late pull could read KV prefill had already released. Shared by the tiny model's KV-integrity tests and
the real model's answer checks."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pdserve import httpclient
from pdserve.engines.backend import LocalEngines
from pdserve.prometheus import parse_prometheus
from pdserve.stack import Stack


def prompt(tag: str) -> str:
    return f"{tag} {uuid.uuid4().hex[:6]}: " + "the ferry crossed the grey water twice a day and " * 6


def suspects(stack: Stack) -> float:
    """Handoffs the proxy's lease guard did not trust, as its /metrics counts them."""
    response = httpclient.get(f"{stack.proxy_url}/metrics", 10)
    return parse_prometheus(response.body.decode()).get("pdserve_kv_handoffs_suspect_total", 0.0)


@contextmanager
def prefill_kept_busy(stack: Stack) -> Iterator[None]:
    """Other prompts straight to prefill: it steps (so it reaps leases) and reuses freed blocks."""
    stop = threading.Event()
    prefill = stack.urls("prefill")[0]
    assert stack.model is not None
    model = stack.model.served_model_name or stack.model.path

    def churn() -> None:
        while not stop.is_set():
            body = {"model": model, "prompt": prompt("churn") * 2, "max_tokens": 2}
            try:
                httpclient.post_json(f"{prefill}/v1/completions", body, timeout=30)
            except Exception:
                time.sleep(0.2)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=35)


def ask_with_decode_stalled(stack: Stack, ask: Callable[[], str]) -> str:
    """``ask()``'s answer, asked while decode's engine is stopped for longer than prefill's lease (with
    prefill kept stepping, so the lease is reaped); any error ``ask`` raises is raised here."""
    assert isinstance(stack.engines, LocalEngines)
    engine = stack.engines.group.engine_core_pid(next(s for s in stack.specs if s.role == "decode"))
    assert engine is not None, "no EngineCore child of decode's API server"
    answer: dict[str, object] = {}

    def run() -> None:
        try:
            answer["text"] = ask()
        except Exception as exc:
            answer["error"] = exc

    # The API server takes the request; the engine, stopped, never schedules it and sends no heartbeat.
    os.kill(engine, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        with prefill_kept_busy(stack):
            time.sleep((stack.topology.kv_lease_s or 30.0) + 6)
    finally:
        os.kill(engine, signal.SIGCONT)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the request hung after decode resumed"
    if "error" in answer:
        raise AssertionError(f"the client got an error: {answer['error']!r}")
    return str(answer["text"])
