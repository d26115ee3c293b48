"""verify's per-request proof and answer oracle on simulated instances behind a real proxy: it passes
beside other clients' traffic and under bf16-style noise, and the oracle catches wrong KV at the
tolerance used on GPUs."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from decode_front import decode_front, last_block_swapped
from live_proxy import LiveProxy, live_proxy, proxy_for
from pdserve import httpclient, kvproof, protocol
from pdserve.commands.verify import verify
from pdserve.config import ProxyConfig
from pdserve.configparts import ApiKeys, Routing
from pdserve.errors import Unreachable


@pytest.fixture(scope="module")
def proxy() -> Iterator[LiveProxy]:
    with live_proxy(num_prefill=1, num_decode=2, prompt_tokens_details=True) as live:
        yield live


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpclient.post_json(f"{url}/v1/completions", body, timeout=30)
    assert response.status == 200, response.body[:300]
    data = response.json()
    assert isinstance(data, dict)
    return data


def _set_noise(live: LiveProxy, noise: float) -> None:
    for url in (*live.prefill, *live.decode):
        response = httpclient.post_json(f"{url}/sim/faults", {"logprob_noise": noise}, timeout=10)
        assert response.status == 200


def test_verify_passes_while_other_clients_send_traffic(proxy: LiveProxy) -> None:
    stop = threading.Event()
    sent = [0]

    def client(n: int) -> None:
        while not stop.is_set():
            proxy.complete(f"other client {n} request {sent[0]} " + "words " * 40, max_tokens=8)
            sent[0] += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(3)]
    for t in threads:
        t.start()
    try:
        report = verify(proxy.url, say=lambda _line: None)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert report.ok, "\n".join(report.lines())
    assert sent[0] > 0
    # Every request's own transfer is named: one line per answer, with its request id.
    assert sum("decode computed 0 of" in what and "[verify-" in what for _, what in report.checks) == 4


def test_verify_passes_under_bf16_style_noise_that_exact_comparison_would_fail(proxy: LiveProxy) -> None:
    _set_noise(proxy, 0.03)
    try:
        report = verify(proxy.url, say=lambda _line: None)
        assert report.ok, "\n".join(report.lines())
        exact = verify(proxy.url, say=lambda _line: None, tolerance=kvproof.FLOAT32)
        assert not exact.ok  # the noise is real: only the stated bf16 tolerance lets it pass
    finally:
        _set_noise(proxy, 0.0)


def _prefill(live: LiveProxy, ids: list[int]) -> dict[str, Any]:
    body = {"model": live.model, "prompt": ids, "max_tokens": 16, "temperature": 0.0}
    answer = _post(live.prefill[0], protocol.prefill_body(body))
    return dict(answer["kv_transfer_params"])


def _fresh_ids(rand: random.Random, n: int = 200) -> list[int]:
    return [rand.randrange(100, 900) for _ in range(n)]


def test_wrong_kv_transfers_by_every_count_and_fails_the_oracle_at_the_gpu_tolerance(
    proxy: LiveProxy,
) -> None:
    rand = random.Random()
    mine, other = _fresh_ids(rand), _fresh_ids(rand)  # fresh from the first token, the same length
    body = {"model": proxy.model, "prompt": mine, "max_tokens": 16, "temperature": 0.0}
    _prefill(proxy, mine)
    wrong = kvproof.with_evidence(protocol.decode_body(body, _prefill(proxy, other)), "completions")
    evidence = kvproof.evidence_of([_post(proxy.decode[0], wrong)])
    assert evidence.transfer()[0]  # the blocks came over: the transfer proof cannot see whose they were
    agreement = kvproof.teacher_forced(proxy.decode[1], proxy.model, evidence)
    assert not agreement.within(kvproof.BF16), agreement.says()
    assert agreement.mean > 10 * kvproof.BF16.max_mean

    # Decode cached the wrong blocks under its prompt's hashes (as vLLM does): the healthy case takes a
    # prompt of its own.
    body = {**body, "prompt": (fresh := _fresh_ids(rand))}
    right = kvproof.with_evidence(protocol.decode_body(body, _prefill(proxy, fresh)), "completions")
    evidence = kvproof.evidence_of([_post(proxy.decode[0], right)])
    assert kvproof.teacher_forced(proxy.decode[1], proxy.model, evidence).within(kvproof.FLOAT32)


def test_a_decode_handed_params_it_cannot_use_recomputes_and_the_proof_says_so(proxy: LiveProxy) -> None:
    ids = _fresh_ids(random.Random())
    body = {"model": proxy.model, "prompt": ids, "max_tokens": 8, "temperature": 0.0}
    params = {k: v for k, v in _prefill(proxy, ids).items() if k != "remote_block_ids"}
    answer = _post(proxy.decode[0], kvproof.with_evidence(protocol.decode_body(body, params), "completions"))
    ok, said = kvproof.evidence_of([answer]).transfer()
    assert not ok and "decode computed 200 of 200 prompt tokens" in said


def test_prefills_cached_count_would_hide_a_recompute_which_is_why_the_proxy_drops_it(
    proxy: LiveProxy,
) -> None:
    ids = _fresh_ids(random.Random())
    body = {
        "model": proxy.model,
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0.0,
        **kvproof.EVIDENCE_FIELDS,
    }
    params = {k: v for k, v in _prefill(proxy, ids).items() if k != "remote_block_ids"}
    params["remote_prefill_cached_tokens"] = 200  # as if prefill had it all cached
    answer = _post(proxy.decode[0], {**body, "kv_transfer_params": params})
    assert kvproof.evidence_of([answer]).cached_tokens == 200  # vLLM's front end reports prefill's count


def _failed(report: Any) -> list[str]:
    return [what for ok, what in report.checks if not ok]


def test_wrong_kv_in_the_last_partial_block_fails_every_answer_streamed_or_not(proxy: LiveProxy) -> None:
    with (
        decode_front(proxy.decode[0], last_block_swapped(proxy.prefill[0], proxy.decode[0])) as (
            front_url,
            front,
        ),
        proxy_for(ProxyConfig.pd((proxy.prefill[0],), (front_url,), port=0)) as url,
    ):
        report = verify(url, say=lambda _line: None)
    wrong = [what for what in _failed(report) if "its logprobs agree" in what]
    assert len(front.rewritten) == 4
    # Each request by its own id, the two streamed ones too: their tokens are scored as the whole ones'.
    assert sorted(what.split(" [")[0] for what in wrong) == sorted(label for label, _ in report.answers), (
        "\n".join(report.lines())
    )
    assert all(f"[{rid}]" in " ".join(wrong) for rid in front.rewritten)


def test_verify_proves_through_the_proxy_alone_when_it_cannot_reach_the_instances(
    proxy: LiveProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As from a laptop through a Kubernetes port-forward: only the proxy answers."""
    said: list[str] = []
    with proxy_for(
        ProxyConfig.pd(proxy.prefill, proxy.decode, port=0, api_keys=ApiKeys(admin="admin-secret"))
    ) as url:
        blocked, request = (*proxy.prefill, *proxy.decode), httpclient.request

        def firewalled(address: str, *args: Any, **kwargs: Any) -> httpclient.Response:
            if address.startswith(blocked):
                raise Unreachable(f"{address}: timed out (firewalled)")
            return request(address, *args, **kwargs)

        monkeypatch.setattr(httpclient, "request", firewalled)
        report = verify(url, say=said.append, admin_key="admin-secret")
        without_key = verify(url, say=lambda _line: None)
    assert report.ok, "\n".join(report.lines())
    assert any(f"cannot reach decode instance {proxy.decode[0]}" in line for line in said), said
    assert sum("(through the proxy" in what for _, what in report.checks) == 4
    # Without the admin key the proxy refuses the reference, and verify says it could not prove.
    assert not without_key.ok
    assert any("admin key" in what for what in _failed(without_key)), "\n".join(without_key.lines())


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tokenizer of one token a word, for the proxy's --skip-prefill-below count (none ships with the
    simulator)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("word-tokenizer")
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(path)


def _skipping(proxy: LiveProxy, tokenizer: str, below: int) -> ProxyConfig:
    routing = Routing(tokenizer=tokenizer, skip_prefill_below_tokens=below)
    return ProxyConfig.pd(proxy.prefill, proxy.decode, port=0, routing=routing)


def test_a_proxy_that_keeps_every_prompt_whole_cannot_be_proven_and_verify_says_so(
    proxy: LiveProxy, word_tokenizer: str
) -> None:
    config = _skipping(proxy, word_tokenizer, 10**6)
    with proxy_for(config) as url:
        report = verify(url, say=lambda _line: None)
    failed = _failed(report)
    assert "cannot prove: this pool never splits" in failed[-1], "\n".join(report.lines())
    assert all("served it whole" in what for what in failed[:-1])


def test_a_skip_prefill_proxy_is_proven_on_prompts_long_enough_to_be_split(
    proxy: LiveProxy, word_tokenizer: str
) -> None:
    config = _skipping(proxy, word_tokenizer, 1000)  # over verify's first prompts, under the longer ones
    with proxy_for(config) as url:
        report = verify(url, say=lambda _line: None)
    assert report.ok, "\n".join(report.lines())
    assert all("-longer]" in what for what in report.lines() if "decode computed" in what)
