"""One named instance's whole answer through the proxy (X-Pdserve-Whole-On): what `pdserve verify` scores
PD answers against when it can reach only the proxy. Behind the admin key; no prefill, no other instance."""

from __future__ import annotations

import aiohttp
import pytest
from fake_vllm import FakeVLLM
from proxy_rig import Rig, running_proxy, serve_fake
from test_admin import call
from test_flow import COMPLETION

from pdserve.configparts import ApiKeys

WHOLE_ON_DECODE = {"X-Pdserve-Whole-On": "decode-1", "X-Pdserve-Admin-Key": "admin-secret"}


async def test_the_named_decode_serves_it_whole_and_only_with_the_admin_key(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    other = FakeVLLM("decode")
    with (
        serve_fake(other) as other_url,
        running_proxy(
            [rig.prefill_url], [rig.decode_url, other_url], api_keys=ApiKeys(admin="admin-secret")
        ) as url,
    ):
        status, body = await call(
            http, "POST", url + "/v1/completions", COMPLETION, {"X-Pdserve-Whole-On": "decode-1"}
        )
        assert status == 401 and "admin key" in body["error"]["message"]
        for _ in range(3):  # a round robin would have sent some of these to decode-0
            headers = {**WHOLE_ON_DECODE, "X-Request-Id": "whole-on-1"}
            status, body = await call(http, "POST", url + "/v1/completions", COMPLETION, headers)
            assert status == 200 and body["choices"][0]["text"], body
        admin = {"Authorization": "Bearer admin-secret"}
        status, listing = await call(http, "GET", url + "/requests?id=whole-on-1", headers=admin)
        [trace, *_] = listing["requests"]
        assert trace["decode_url"] == other_url and trace["prefill_url"] is None
        assert "X-Pdserve-Whole-On" in trace["local_prefill_reason"]
    assert rig.prefill.generations() == [] and rig.decode.generations() == []
    seen = other.generations()
    assert len(seen) == 3 and all(s.body is not None and "kv_transfer_params" not in s.body for s in seen)


@pytest.mark.parametrize("name", ["decode-7", "http://127.0.0.1:1"])
async def test_an_instance_the_proxy_does_not_know_is_refused_by_name(
    rig: Rig, http: aiohttp.ClientSession, name: str
) -> None:
    status, body = await call(
        http, "POST", rig.url + "/v1/completions", COMPLETION, {"X-Pdserve-Whole-On": name}
    )
    assert status == 404 and "decode-0" in body["error"]["message"], body
    assert rig.decode.generations() == [] and rig.prefill.generations() == []


async def test_a_failing_named_instance_is_the_answer_not_another_instance(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    rig.decode.fault = "fail"
    status, _ = await call(
        http, "POST", rig.url + "/v1/completions", COMPLETION, {"X-Pdserve-Whole-On": "decode-0"}
    )
    assert status >= 500
    assert rig.prefill.generations() == []
