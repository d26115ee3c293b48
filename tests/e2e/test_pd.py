"""PD through the proxy on real vLLM: the answer is right and the KV really crossed over NIXL."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from pdserve.commands.verify import wait_for_transfers
from pdserve.config import ProxyConfig, Timeouts
from pdserve.configparts import Retries
from pdserve.engines.backend import LocalEngines
from pdserve.engines.transfers import transfer_counts
from pdserve.proxy.serving.thread import ProxyThread
from pdserve.stack import Stack

# Each role's failure reaches the client: the tests of that path need no survivor stepping in.
STRICT = Retries(fallback_to_local_prefill=False, prefill_stands_in=False)

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16


def _prompt(tag: str) -> str:
    # A fresh prompt per test: decode's prefix cache must not hold it from an earlier request.
    return f"{tag} {uuid.uuid4().hex[:6]}: the lighthouse keeper climbed the stairs and"


def _complete(
    client: openai.OpenAI, model: str, chat: bool, stream: bool, prompt: str, **extra: object
) -> str:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True, **extra
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        resp = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **extra
        )
        return resp.choices[0].message.content or ""
    if stream:
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, **extra
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **extra
    )
    return resp.choices[0].text


@contextmanager
def one_transfer(stack: Stack) -> Iterator[None]:
    """Assert the block caused exactly one successful NIXL transfer on decode and no failed one."""
    decode_urls = stack.urls("decode")
    before = transfer_counts(decode_urls)
    yield
    delta = wait_for_transfers(decode_urls, before, expected=1)
    assert delta.successful == 1, f"decode's transfer counter rose by {delta.successful}, expected 1"
    assert delta.failed == 0, f"decode counted {delta.failed} failed transfers"
    assert delta.bytes > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_pd_answer_equals_single_instance_and_kv_moved_once(
    stack: Stack,
    client: openai.OpenAI,
    decode_alone: openai.OpenAI,
    model_name: str,
    chat: bool,
    stream: bool,
) -> None:
    prompt = _prompt("pd")
    with one_transfer(stack):
        text = _complete(client, model_name, chat, stream, prompt)
    assert text, "PD answer is empty"
    assert text == _complete(decode_alone, model_name, chat, stream=False, prompt=prompt)


def test_client_kv_transfer_params_never_reach_decode(
    stack: Stack, client: openai.OpenAI, decode_alone: openai.OpenAI, model_name: str
) -> None:
    # Were these forwarded, decode would try to pull from this dead local port and fail the request.
    forged = {
        "do_remote_prefill": True,
        "remote_engine_id": "forged",
        "remote_request_id": "forged",
        "remote_block_ids": [[1]],
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
    }
    prompt = _prompt("forged")
    with one_transfer(stack):
        resp = client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"kv_transfer_params": forged},
        )
    assert resp.choices[0].text == _complete(decode_alone, model_name, False, False, prompt)
    assert resp.model_extra is None or "kv_transfer_params" not in resp.model_extra


def test_bad_max_tokens_gets_vllms_own_400(client: openai.OpenAI, model_name: str) -> None:
    # Prefill runs with max_tokens=1 and accepts; only decode sees the client's -1.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hello", max_tokens=-1)
    assert "max_tokens" in str(info.value)


def test_unknown_model_gets_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=4)


def test_frozen_prefill_ends_request_with_clear_error_then_recovers(
    stack: Stack, client: openai.OpenAI, model_name: str
) -> None:
    """A prefill instance that stops answering gives a 504 naming it within the timeout, not a hang."""
    assert isinstance(stack.engines, LocalEngines)
    prefill = next(s for s in stack.specs if s.role == "prefill")
    pgid = stack.engines.group.pid(prefill)
    assert pgid is not None
    quick = ProxyThread(
        ProxyConfig.pd(
            tuple(stack.urls("prefill")),
            tuple(stack.urls("decode")),
            port=18010,
            timeouts=Timeouts(connect=2, prefill=3),
            retries=STRICT,  # prefill's failure reaches the client: no decode computing the prompt
        )
    )
    quick.start()
    quick_client = openai.OpenAI(base_url=f"{quick.url}/v1", api_key="unused", max_retries=0, timeout=30)
    os.killpg(pgid, signal.SIGSTOP)
    try:
        begun = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            quick_client.completions.create(model=model_name, prompt=_prompt("frozen"), max_tokens=4)
        elapsed = time.monotonic() - begun
    finally:
        os.killpg(pgid, signal.SIGCONT)
        quick.stop()
    assert info.value.status_code == 504
    # Named as `pdserve up` and its logs name it; its URL stays out of what clients read.
    assert f"prefill instance {prefill.name}" in str(info.value) and prefill.url not in str(info.value)
    assert elapsed < 8, f"took {elapsed:.1f} s to report a frozen prefill"
    # The instance is back: the main proxy serves again.
    assert _complete(client, model_name, chat=False, stream=False, prompt=_prompt("after-freeze"))


def test_dead_prefill_url_fails_fast_naming_it(stack: Stack, model_name: str) -> None:
    dead = "http://127.0.0.1:18099"
    proxy = ProxyThread(ProxyConfig.pd((dead,), tuple(stack.urls("decode")), port=18011, retries=STRICT))
    proxy.start()
    try:
        c = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)
        begun = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model=model_name, prompt="hello", max_tokens=4)
        elapsed = time.monotonic() - begun
    finally:
        proxy.stop()
    assert info.value.status_code == 502
    assert "prefill instance prefill-0: cannot connect" in str(info.value) and dead not in str(info.value)
    assert elapsed < 5
