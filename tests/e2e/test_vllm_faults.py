"""Key faults on real vLLM: every request ends promptly with a clear error, prefill's KV comes back,
and the system serves again afterwards. Kills and restarts instances, so it runs last in the session
(modules run in name order)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import openai
import pytest

from pdserve.config import ProxyConfig, Timeouts
from pdserve.engines.metrics import scrape, transfer_counts
from pdserve.engines.plan import InstanceSpec
from pdserve.prometheus import KV_USAGE
from pdserve.stack import ProxyThread, Stack, wait_http_ok
from pdserve.verify import wait_for_transfers

pytestmark = pytest.mark.vllm

LEASE_S = 30.0  # vLLM's default kv_lease_duration: un-pulled KV is held at most this long
QUICK = Timeouts(connect=2, prefill=10, first_token=10, idle=5, decode=20)


def _prompt(tag: str, words: int = 60) -> str:
    return f"{tag} {uuid.uuid4().hex[:6]}: " + "the harbour lights came on one by one " * (words // 8)


def _wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def _spec(stack: Stack, role: str) -> InstanceSpec:
    return next(s for s in stack.specs if s.role == role)


def _pgid(stack: Stack, role: str) -> int:
    assert stack.group is not None
    pid = stack.group.pid(_spec(stack, role))
    assert pid is not None
    return pid


def _kv_usage(url: str) -> float:
    return scrape(url).get(KV_USAGE, 0.0)


@pytest.fixture
def quick(stack: Stack) -> Iterator[tuple[ProxyThread, openai.OpenAI]]:
    """A proxy with short timeouts in front of the session's instances."""
    proxy = ProxyThread(
        ProxyConfig(tuple(stack.urls("prefill")), tuple(stack.urls("decode")), port=18020, timeouts=QUICK)
    )
    proxy.start()
    try:
        yield proxy, openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        proxy.stop()


def _serves_again(stack: Stack, client: openai.OpenAI, model: str) -> None:
    """After a fault: the instances are healthy and a request moves its KV over NIXL once."""
    assert wait_http_ok(f"{stack.proxy_url}/health", timeout=60), (
        "the proxy never saw both roles healthy again"
    )
    before = transfer_counts(stack.urls("decode"))
    answer = client.completions.create(model=model, prompt=_prompt("again"), max_tokens=8, temperature=0)
    assert answer.choices[0].text
    delta = wait_for_transfers(stack.urls("decode"), before, expected=1)
    assert (delta.successful, delta.failed) == (1, 0)


def test_client_leaving_between_phases_gets_its_kv_back_on_prefill_within_the_lease(
    stack: Stack, quick: tuple[ProxyThread, openai.OpenAI], client: openai.OpenAI, model_name: str
) -> None:
    _, quick_client = quick
    prefill = stack.urls("prefill")[0]
    idle = _kv_usage(prefill)
    decode_pgid = _pgid(stack, "decode")
    os.killpg(decode_pgid, signal.SIGSTOP)  # prefill answers; decode never does
    try:
        impatient = quick_client.with_options(timeout=4)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=model_name, prompt=_prompt("leaver"), max_tokens=4)
        held = _kv_usage(prefill)
        assert held > idle, "prefill should be holding the prompt's KV for the missing decode"
        # Nobody will pull it: vLLM's lease frees it.
        assert _wait_until(lambda: _kv_usage(prefill) <= idle, timeout=LEASE_S + 15), (
            f"prefill still holds KV {LEASE_S + 15:.0f} s after the client left"
        )
    finally:
        os.killpg(decode_pgid, signal.SIGCONT)
    _serves_again(stack, client, model_name)


def test_prefill_killed_mid_request_is_a_prompt_clear_error_and_serving_resumes_after_restart(
    stack: Stack, quick: tuple[ProxyThread, openai.OpenAI], client: openai.OpenAI, model_name: str
) -> None:
    _, quick_client = quick
    spec = _spec(stack, "prefill")
    pgid = _pgid(stack, "prefill")
    os.killpg(pgid, signal.SIGSTOP)  # the request is certainly inside prefill when the kill comes
    outcome: dict[str, object] = {}

    def request() -> None:
        try:
            quick_client.completions.create(model=model_name, prompt=_prompt("killed"), max_tokens=4)
        except openai.APIStatusError as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    os.killpg(pgid, signal.SIGKILL)
    thread.join(timeout=QUICK.prefill + 5)
    assert not thread.is_alive(), "the request hung after prefill died"
    error = outcome.get("error")
    assert isinstance(error, openai.APIStatusError) and error.status_code in (502, 504)
    assert "prefill" in str(error) and spec.url in str(error)
    assert float(outcome["at"]) - killed_at < 5  # type: ignore[arg-type]
    assert stack.group is not None
    stack.group.restart(spec)
    _serves_again(stack, client, model_name)


def test_decode_killed_mid_stream_ends_the_stream_with_an_error_and_serving_resumes(
    stack: Stack, quick: tuple[ProxyThread, openai.OpenAI], client: openai.OpenAI, model_name: str
) -> None:
    _, quick_client = quick
    spec = _spec(stack, "decode")
    pgid = _pgid(stack, "decode")
    prefill = stack.urls("prefill")[0]
    stream = quick_client.completions.create(
        model=model_name, prompt=_prompt("midstream", 16), max_tokens=1500, temperature=0, stream=True
    )
    received = 0
    killed_at = 0.0
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received += sum(1 for c in chunk.choices if c.text)
            if received == 10:
                killed_at = time.monotonic()
                os.killpg(pgid, signal.SIGKILL)
    assert killed_at, "the stream ended before decode could be killed"
    assert time.monotonic() - killed_at < QUICK.idle + 3
    assert received < 1500  # cut short, and the client was told so rather than handed a short answer
    # The KV was pulled before the first token, so prefill holds nothing for this request.
    assert _wait_until(lambda: _kv_usage(prefill) == 0.0, timeout=LEASE_S + 15)
    assert stack.group is not None
    stack.group.restart(spec)
    _serves_again(stack, client, model_name)
