"""An elastic pool of three real vLLM instances (`pdserve up --elastic 3 --model tiny`) behind the proxy:
every instance is a kv_consumer (never the deprecated kv_both) and still takes any role. Through the
proxy, greedy answers equal one instance's alone, streamed or not, completions or chat; each request the
router split moved its KV exactly once over NIXL and each it kept whole moved none; and /requests says
which it was, where, and why.

The proxy plans with no step costs (the router's rule then: long prompts split, short ones whole), so a
few requests give both decisions. A pool of its own on ports of its own (18600-18799, side channels
16000-16099): its transfer counts must move only with these requests."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from greedy import greedy_text

from conftest import E2E_TOPOLOGY
from pdserve import httpclient, kvproof
from pdserve.commands.verify import verify, wait_for_transfers
from pdserve.config import ProxySettings, RoleSpec
from pdserve.engines.transfers import transfer_counts
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm

LONG_PROMPT = " ".join(["the harbour lights came on one by one"] * 90)  # ~800 tokens: split
SHORT_PROMPT = "the harbour lights came on"  # a few tokens: whole


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = Path(tmp_path_factory.mktemp("elastic-run"))
    topology = dataclasses.replace(
        E2E_TOPOLOGY, elastic=RoleSpec(count=3), proxy_port=18600, first_port=18700,
        first_side_channel_port=16000, run_dir=str(run_dir),
    )  # fmt: skip
    # No --cost-profile: the pool's ElasticPool has no step costs (`up` would give it tiny-cpu's).
    with Stack(topology, say=lambda m: print(f"[elastic] {m}", flush=True), proxy=ProxySettings()) as s:
        yield s


@pytest.fixture(scope="module")
def model(pool: Stack) -> str:
    assert pool.model is not None
    return pool.model.served_model_name or pool.model.path


def _ask(url: str, model: str, kind: str, prompt: str, stream: bool, request_id: str | None = None) -> str:
    return greedy_text(url, model, kind, prompt, stream, request_id, max_tokens=12)


def _record(pool: Stack, request_id: str) -> dict[str, Any]:
    answer = httpclient.get(f"{pool.proxy_url}/requests?id={request_id}", 10)
    assert answer.status == 200, answer.body[:300]
    [record] = answer.json()["requests"]
    assert isinstance(record, dict)
    return record


def test_every_instance_takes_any_role_as_a_kv_consumer_without_vllms_kv_both(pool: Stack) -> None:
    assert [s.name for s in pool.specs] == ["elastic-0", "elastic-1", "elastic-2"]
    for spec in pool.specs:
        log = (pool.run_dir / f"{spec.name}.log").read_text()
        assert "kv_role='kv_consumer'" in log or '"kv_role":"kv_consumer"' in log
        assert "kv_role='kv_both' with NixlConnector is deprecated" not in log


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_router_splits_long_prompts_and_keeps_short_ones_whole_each_answer_as_one_instance_alone(
    pool: Stack, model: str, kind: str, stream: bool
) -> None:
    alone = pool.urls("elastic")[0]
    decisions = []
    for prompt in (LONG_PROMPT, SHORT_PROMPT):
        prompt = f"{uuid.uuid4().hex[:8]} {prompt}"  # no prefix cached from another test
        request_id = f"elastic-{kind}-{uuid.uuid4().hex[:12]}"
        # Summed over every instance (vllm:nixl_xfer_time_seconds_count): whichever decoded counts it.
        before = transfer_counts(pool.urls("elastic"))
        text = _ask(pool.proxy_url, model, kind, prompt, stream, request_id)
        record = _record(pool, request_id)
        placement = record["placement"]
        moved = wait_for_transfers(pool.urls("elastic"), before, expected=1 if placement["split"] else 0)
        assert moved.failed == 0, record
        assert text and text == _ask(alone, model, kind, prompt, stream)
        assert placement["decode_url"] == record["decode_url"] and placement["reason"], record
        if placement["split"]:
            assert placement["prefill_url"] == record["prefill_url"] != placement["decode_url"], record
            assert moved.successful == 1 and moved.bytes > 0, record  # its KV crossed over NIXL, once
        else:
            assert placement["prefill_url"] is None and moved.successful == 0, record
        decisions.append(placement["split"])
    assert decisions == [True, False]  # long split, short whole


def test_the_proxy_lists_each_instance_once_with_the_side_the_router_gave_it(pool: Stack) -> None:
    # After the requests above: the router gives the instances their sides as it places the first one.
    listing = httpclient.get(f"{pool.proxy_url}/instances", 10).json()
    assert sorted(i["url"] for i in listing) == sorted(pool.urls("elastic"))
    assert all(i["role"] == "elastic" and i["side"] in ("prefill", "decode") for i in listing), listing


def test_verify_proves_the_split_path_of_the_pool_with_prompts_long_enough_to_be_split(pool: Stack) -> None:
    said: list[str] = []
    report = verify(pool.proxy_url, say=said.append, tolerance=kvproof.FLOAT32)
    assert report.ok, "\n".join(report.lines())
    assert any("an elastic pool of 3 instance(s)" in line for line in said), said
    assert sum("decode computed 0 of" in what for _, what in report.checks) == 4
    assert not any("served it whole" in what for _, what in report.checks)
