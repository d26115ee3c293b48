"""Never a 200 built from released KV, on real vLLM: a decode engine stalled past prefill's lease, and
cores saturated by other processes. Every answer must equal the one instance alone gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
from stall import ask_with_decode_stalled, prompt, suspects
from test_pd import MAX_TOKENS, _complete

from pdserve import httpclient
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_decode_stalled_past_the_lease_never_yields_an_answer_from_released_kv(
    stack: Stack, client: openai.OpenAI, decode_alone: openai.OpenAI, model_name: str, stream: bool
) -> None:
    text = prompt("stalled")
    expected = _complete(decode_alone, model_name, chat=False, stream=False, prompt=text)
    suspects_before = suspects(stack)
    answer = ask_with_decode_stalled(
        stack, lambda: _complete(client, model_name, chat=False, stream=stream, prompt=text)
    )
    # Once decode steps again, the redo's fresh handoff is pulled in time: the client gets the answer.
    assert answer == expected, "decode's answer was built from released KV and relayed"
    assert suspects(stack) > suspects_before, "the late pull went unnoticed"
    # The late pull's blocks went into decode's prefix cache under this prompt's hashes: the guard
    # reset it (vLLM's dev-mode route, on for decodes pdserve starts), and the next turn misses them.
    metrics = httpclient.get(f"{stack.proxy_url}/metrics", 10).body.decode()
    assert 'pdserve_decode_prefix_cache_resets_total{result="ok"}' in metrics, metrics
    again = _complete(client, model_name, chat=False, stream=stream, prompt=text)
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
        (chat, stream, prompt(f"busy-{chat}-{stream}")) for chat in (False, True) for stream in (False, True)
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
