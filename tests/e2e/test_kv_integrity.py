"""Never a 200 built from released KV, on real vLLM: a decode engine stalled past prefill's lease, and
cores saturated by other processes. Every answer must equal the one instance alone gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
from test_pd import MAX_TOKENS, _complete

from pdserve import httpclient
from pdserve.engines.backend import LocalEngines
from pdserve.prometheus import parse_prometheus
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm


def _prompt(tag: str) -> str:
    return f"{tag} {uuid.uuid4().hex[:6]}: " + "the ferry crossed the grey water twice a day and " * 6


def _lease(stack: Stack) -> float:
    return stack.topology.kv_lease_s or 30.0


def _suspects(stack: Stack) -> float:
    """Handoffs the proxy's lease guard did not trust, as its /metrics counts them."""
    response = httpclient.get(f"{stack.proxy_url}/metrics", 10)
    return parse_prometheus(response.body.decode()).get("pdserve_kv_handoffs_suspect_total", 0.0)


@contextmanager
def _prefill_kept_busy(stack: Stack) -> Iterator[None]:
    """Other prompts straight to prefill: it steps (so it reaps leases) and reuses freed blocks."""
    stop = threading.Event()
    prefill = stack.urls("prefill")[0]
    assert stack.model is not None
    model = stack.model.served_model_name or stack.model.path

    def churn() -> None:
        while not stop.is_set():
            body = {"model": model, "prompt": _prompt("churn") * 2, "max_tokens": 2}
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


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_decode_stalled_past_the_lease_never_yields_an_answer_from_released_kv(
    stack: Stack, client: openai.OpenAI, decode_alone: openai.OpenAI, model_name: str, stream: bool
) -> None:
    prompt = _prompt("stalled")
    expected = _complete(decode_alone, model_name, chat=False, stream=False, prompt=prompt)
    assert isinstance(stack.engines, LocalEngines)
    engine = stack.engines.group.engine_core_pid(next(s for s in stack.specs if s.role == "decode"))
    assert engine is not None, "no EngineCore child of decode's API server"
    suspects_before = _suspects(stack)
    answer: dict[str, object] = {}

    def ask() -> None:
        try:
            answer["text"] = _complete(client, model_name, chat=False, stream=stream, prompt=prompt)
        except openai.APIError as exc:
            answer["error"] = exc

    # The API server takes the request; the engine, stopped, never schedules it and sends no heartbeat.
    os.kill(engine, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=ask)
        thread.start()
        with _prefill_kept_busy(stack):
            time.sleep(_lease(stack) + 6)
    finally:
        os.kill(engine, signal.SIGCONT)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the request hung after decode resumed"
    # Once decode steps again, the redo's fresh handoff is pulled in time: the client gets the answer.
    assert "error" not in answer, answer.get("error")
    assert answer["text"] == expected, "decode's answer was built from released KV and relayed"
    assert _suspects(stack) > suspects_before, "the late pull went unnoticed"
    # The late pull's blocks went into decode's prefix cache under this prompt's hashes: the guard
    # reset it (vLLM's dev-mode route, on for decodes pdserve starts), and the next turn misses them.
    metrics = httpclient.get(f"{stack.proxy_url}/metrics", 10).body.decode()
    assert 'pdserve_decode_prefix_cache_resets_total{result="ok"}' in metrics, metrics
    again = _complete(client, model_name, chat=False, stream=stream, prompt=prompt)
    assert again == expected, "a later request with the same prompt reused the late pull's blocks"


@contextmanager
def _cores_saturated(num_hogs: int = 4) -> Iterator[None]:
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(num_hogs)
    ]
    try:
        yield
    finally:
        for hog in hogs:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait(timeout=10)


def test_with_every_core_saturated_every_request_gets_the_single_instance_answer(
    client: openai.OpenAI, decode_alone: openai.OpenAI, model_name: str
) -> None:
    cases = [
        (chat, stream, _prompt(f"busy-{chat}-{stream}")) for chat in (False, True) for stream in (False, True)
    ]
    expected = [_complete(decode_alone, model_name, chat, False, prompt) for chat, _, prompt in cases]
    results: list[str | Exception] = [""] * len(cases)

    def ask(i: int) -> None:
        chat, stream, prompt = cases[i]
        try:
            results[i] = _complete(client, model_name, chat, stream, prompt)
        except openai.APIError as exc:
            results[i] = exc

    with _cores_saturated():
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    assert all(not t.is_alive() for t in threads), "a request hung on the saturated machine"
    assert results == expected, f"{MAX_TOKENS}-token answers differ from one instance alone: {results}"
