"""Prompt-aware routing through the proxy: prefix affinity on prefill, short prompts skip prefill."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from fake_vllm import FakeVLLM
from proxy_rig import Rig, running_proxy, serve_fake
from test_flow import COMPLETION, post
from test_tokens import SYSTEM, _write_model_dir

from pdserve.config import ProxyConfig
from pdserve.configparts import PoolSpec, Routing
from pdserve.proxy.serving.app import create_app


async def test_short_prompts_skip_prefill_and_long_ones_are_split(
    rig: Rig, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    model_dir = _write_model_dir(tmp_path)
    with running_proxy(
        [rig.prefill_url],
        [rig.decode_url],
        routing=Routing(tokenizer=str(model_dir), skip_prefill_below_tokens=64),
    ) as url:
        assert (await post(http, url + "/v1/completions", {**COMPLETION, "prompt": "hi"}))[0] == 200
        assert rig.prefill.generations() == []  # a two-token prompt is cheaper on decode alone
        long_prompt = SYSTEM * 2
        assert (await post(http, url + "/v1/completions", {**COMPLETION, "prompt": long_prompt}))[0] == 200
    assert len(rig.prefill.generations()) == 1
    assert "kv_transfer_params" in rig.decode.generations()[-1].body
    assert "kv_transfer_params" not in rig.decode.generations()[0].body


async def test_prefix_aware_keeps_a_shared_system_prompt_on_one_prefill_instance(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    model_dir = _write_model_dir(tmp_path)
    prefills, decode = [FakeVLLM("prefill"), FakeVLLM("prefill")], FakeVLLM("decode")
    with (
        serve_fake(prefills[0]) as p0,
        serve_fake(prefills[1]) as p1,
        serve_fake(decode) as d0,
        running_proxy(
            pools=(PoolSpec("prefill", (p0, p1), policy="prefix_aware"), PoolSpec("decode", (d0,))),
            routing=Routing(tokenizer=str(model_dir), prefix_block_size=4),
        ) as url,  # fmt: skip
    ):
        for question in ("what is prefill?", "what is decode?", "why split them?", "what is NIXL?"):
            body = {**COMPLETION, "prompt": SYSTEM + question}
            assert (await post(http, url + "/v1/completions", body))[0] == 200
    # The four sharing a system prompt stay together, where round robin would split them 2/2.
    assert sorted(len(p.generations()) for p in prefills) == [0, 4]


def test_a_restarted_instance_is_no_longer_thought_to_hold_any_prefix() -> None:
    config = ProxyConfig(
        pools=(
            PoolSpec("prefill", ("http://p:1",), policy="prefix_aware"),
            PoolSpec("decode", ("http://d:1",)),
        )
    )
    state = create_app(config).state.pdserve.state
    [instance] = state.pool("prefill").instances
    policy = state.policy("prefill")
    policy.pick([instance], [1, 2, 3])
    assert policy.pick([instance], [1, 2, 3]).num_cached_tokens == 3 * config.routing.prefix_block_size
    instance.check_failed("cannot connect")  # never answered: out at once
    state.check_passed(instance, None)  # what a health check reports when it sees the instance back
    assert policy.pick([instance], [1, 2, 3]).num_cached_tokens == 0
