"""The per-request proof on the real vLLM pair: verify passes while other clients send traffic (beside
heavy traffic too, waiting its turn and naming its requests), fails
naming the request whose decode recomputed its prompt (even while other requests transfer), and the
teacher-forced oracle catches wrong KV (decode handed another fresh prompt's params) at the bf16
tolerance used on GPUs, though every counter and the cached-token count say the KV came over."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from test_doctor_vllm import _proxy

from decode_front import decode_front
from pdserve import httpclient, kvproof, protocol
from pdserve.commands.verify import verify
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm


@contextmanager
def _other_clients(url: str, model: str, num: int = 2, max_tokens: int = 8) -> Iterator[list[int]]:
    """``num`` clients sending PD requests through ``url`` until the block ends; yields [sent, ok]."""
    stop, counts = threading.Event(), [0, 0]

    def client() -> None:
        while not stop.is_set():
            prompt = f"other client {uuid.uuid4().hex}: " + "the mill and the river " * 20
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            status = httpclient.post_json(f"{url}/v1/completions", body, 120).status
            counts[0] += 1
            counts[1] += status == 200

    threads = [threading.Thread(target=client, daemon=True) for _ in range(num)]
    for thread in threads:
        thread.start()
    try:
        yield counts
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)


def test_verify_passes_while_other_clients_send_traffic(stack: Stack, model_name: str) -> None:
    with _other_clients(stack.proxy_url, model_name) as counts:
        report = verify(stack.proxy_url, say=lambda _m: None)
    assert report.ok, "\n".join(report.lines())
    assert counts[0] > 0 and counts[0] == counts[1]
    # float32 on CPU: the logprobs agreed exactly, and so did the text.
    exact = verify(stack.proxy_url, say=lambda _m: None, tolerance=kvproof.FLOAT32)
    assert exact.ok, "\n".join(exact.lines())


def test_verify_beside_heavy_traffic_passes_and_names_its_requests(stack: Stack, model_name: str) -> None:
    said: list[str] = []
    with _other_clients(stack.proxy_url, model_name, num=22, max_tokens=64) as counts:
        report = verify(stack.proxy_url, say=said.append, tolerance=kvproof.FLOAT32)
    assert report.ok, "\n".join([*report.lines(), *said])
    assert counts[1] > 22
    assert not any("cannot reach" in line for line in said)
    assert said[-1] == "requests sent: " + ", ".join(report.request_ids)
    for rid in (rid for rid in report.request_ids if rid.count("-") == 2):
        listing = httpclient.get(f"{stack.proxy_url}/requests?id={rid}", 10).json()
        assert [r["request_id"] for r in listing["requests"]] == [rid], said


def test_verify_names_the_request_whose_decode_recomputed_the_prompt_beside_other_transfers(
    stack: Stack, model_name: str
) -> None:
    [prefill], [decode] = stack.urls("prefill"), stack.urls("decode")
    dropped: list[tuple[str, dict[str, Any]]] = []

    def without_params(path: str, body: dict[str, Any]) -> dict[str, Any]:
        dropped.append((path, body))
        return {k: v for k, v in body.items() if k != "kv_transfer_params"}

    try:
        with (
            decode_front(decode, without_params) as (front, _),
            _proxy(prefill, front, 18050) as proxy,
            _other_clients(stack.proxy_url, model_name),
        ):
            report = verify(proxy.url, say=lambda _m: None)
    finally:
        for path, body in dropped:  # free prefill's leases now, as test_doctor_vllm does
            httpclient.post_json(decode + path, body, 120)
    assert not report.ok
    failed = [what for ok, what in report.checks if not ok]
    recomputed = [what for what in failed if "it recomputed the prompt" in what]
    assert len(recomputed) == 4, "\n".join(report.lines())  # each of verify's requests, by its own id
    assert all("[verify-" in what for what in recomputed)


def _ids(url: str, model: str, num_tokens: int) -> list[int]:
    text = f"wrong kv {uuid.uuid4().hex}: " + "a small boat passed the old mill by the river " * num_tokens
    response = httpclient.post_json(f"{url}/tokenize", {"model": model, "prompt": text}, 30)
    tokens = response.json()["tokens"]
    assert len(tokens) >= num_tokens
    return list(tokens[:num_tokens])


def _completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpclient.post_json(f"{url}/v1/completions", body, 120)
    assert response.status == 200, response.body[:300]
    data = response.json()
    assert isinstance(data, dict)
    return data


def test_wrong_kv_transfers_by_every_count_but_fails_the_oracle_at_the_gpu_tolerance(
    stack: Stack, model_name: str
) -> None:
    [prefill], [decode] = stack.urls("prefill"), stack.urls("decode")
    # Fresh from the first token and the same length (3 blocks of 128): no local prefix hides the swap.
    mine, other = _ids(decode, model_name, 300), _ids(decode, model_name, 300)
    body = {"model": model_name, "prompt": mine, "max_tokens": 16, "temperature": 0.0}
    params = _completion(prefill, protocol.prefill_body({**body, "prompt": other}))["kv_transfer_params"]
    answer = _completion(decode, kvproof.with_evidence(protocol.decode_body(body, params), "completions"))
    evidence = kvproof.evidence_of([answer])
    assert evidence.transfer()[0], evidence  # the blocks came over: the transfer proof cannot see whose
    agreement = kvproof.teacher_forced(decode, model_name, evidence)
    assert not agreement.within(kvproof.BF16), agreement.says()
