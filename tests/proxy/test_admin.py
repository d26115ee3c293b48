"""Keys, the admin API, overload answers, the proxy's /metrics and the KV ledger, through a real proxy."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from fake_vllm import FakeVLLM
from proxy_rig import Rig, running_proxy, serve_fake
from test_flow import COMPLETION, post

from pdserve.config import ProxyConfig
from pdserve.configparts import AdmissionLimits, ApiKeys
from pdserve.errors import ConfigError
from pdserve.proxy.serving.app import create_app

ADMIN = {"Authorization": "Bearer admin-secret"}


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = None if body is None else orjson.dumps(body)
    async with http.request(method, url, data=data, headers=headers or {}) as resp:
        raw = await resp.read()
        try:
            return resp.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return resp.status, raw.decode()


async def test_api_key_is_required_when_set_and_not_forwarded(rig: Rig, http: aiohttp.ClientSession) -> None:
    with running_proxy([rig.prefill_url], [rig.decode_url], api_keys=ApiKeys(client="client-secret")) as url:
        status, body = await call(http, "POST", url + "/v1/completions", COMPLETION)
        assert status == 401 and body["error"]["type"] == "AuthenticationError"
        ok = {"Authorization": "Bearer client-secret"}
        status, _ = await call(http, "POST", url + "/v1/completions", COMPLETION, ok)
        assert status == 200
    # The proxy's own key is its business: instances never see it.
    assert all("authorization" not in r.headers for r in rig.decode.generations())
    assert len(rig.decode.generations()) == 1


async def test_admin_api_is_off_without_a_key_and_needs_the_key_with_one(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    status, _ = await call(http, "GET", rig.url + "/admin/ledger")
    assert status == 403
    with running_proxy([rig.prefill_url], [rig.decode_url], api_keys=ApiKeys(admin="admin-secret")) as url:
        assert (await call(http, "GET", url + "/admin/ledger"))[0] == 401
        assert (await call(http, "GET", url + "/admin/ledger", headers=ADMIN))[0] == 200
        assert (await call(http, "GET", url + "/requests"))[0] == 401


async def test_instances_are_added_drained_and_removed_at_run_time(
    rig: Rig, http: aiohttp.ClientSession, dead_url: str
) -> None:
    extra = FakeVLLM("decode")
    with (
        serve_fake(extra) as extra_url,
        running_proxy([rig.prefill_url], [rig.decode_url], api_keys=ApiKeys(admin="admin-secret")) as url,
    ):
        status, added = await call(
            http, "POST", url + "/admin/instances", {"role": "decode", "url": extra_url}, ADMIN
        )
        assert status == 201 and added["url"] == extra_url
        for _ in range(4):
            assert (await post(http, url + "/v1/completions", COMPLETION))[0] == 200
        assert len(extra.generations()) == 2  # round robin now spans both decode instances

        status, drained = await call(http, "POST", url + "/admin/instances/drain", {"url": extra_url}, ADMIN)
        assert status == 200 and drained["draining"] is True
        for _ in range(2):
            assert (await post(http, url + "/v1/completions", COMPLETION))[0] == 200
        assert len(extra.generations()) == 2  # a draining instance takes no new requests

        assert (await call(http, "DELETE", url + "/admin/instances", {"url": extra_url}, ADMIN))[0] == 202
        for _ in range(50):
            _, listing = await call(http, "GET", url + "/admin/instances", headers=ADMIN)
            if extra_url not in [i["url"] for i in listing]:
                break
            await asyncio.sleep(0.05)
        assert extra_url not in [i["url"] for i in listing]

        # An instance that does not answer /v1/models is refused, not added.
        status, refused = await call(
            http, "POST", url + "/admin/instances", {"role": "decode", "url": dead_url}, ADMIN
        )
        assert status == 400 and "refusing" in refused["error"]["message"]


async def test_a_removed_prefill_stays_until_no_decode_has_its_kv_left_to_pull(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    """Stopping a prefill whose KV a decode has yet to pull fails that request's pull: a drain counts
    those handoffs, and the removal waits for them to be pulled or let go."""
    rig.decode.fault = "hang"  # decode holds the request: prefill's KV for it is not pulled yet
    with running_proxy([rig.prefill_url], [rig.decode_url], api_keys=ApiKeys(admin="admin-secret")) as url:
        waiting = asyncio.ensure_future(post(http, url + "/v1/completions", COMPLETION))
        for _ in range(250):
            if rig.decode.generations():
                break
            await asyncio.sleep(0.02)
        assert rig.decode.generations(), "the request never reached decode"

        status, removing = await call(
            http, "DELETE", url + "/admin/instances", {"url": rig.prefill_url}, ADMIN
        )
        assert status == 202
        assert (removing["in_flight"], removing["kv_held"], removing["drained"]) == (0, 1, False)
        await asyncio.sleep(0.5)
        _, listing = await call(http, "GET", url + "/admin/instances", headers=ADMIN)
        [prefill] = [i for i in listing if i["url"] == rig.prefill_url]
        assert (prefill["state"], prefill["kv_held"], prefill["drained"]) == ("draining", 1, False)

        waiting.cancel()  # the client goes: its handoff is let go, and nothing holds the prefill any more
        for _ in range(100):
            _, listing = await call(http, "GET", url + "/admin/instances", headers=ADMIN)
            if rig.prefill_url not in [i["url"] for i in listing]:
                break
            await asyncio.sleep(0.05)
        assert rig.prefill_url not in [i["url"] for i in listing]


async def test_overload_answers_429_with_retry_after(rig: Rig, http: aiohttp.ClientSession) -> None:
    rig.prefill.fault = "hang"
    with running_proxy(
        [rig.prefill_url], [rig.decode_url], admission=AdmissionLimits(max_concurrent=1, max_queued=0)
    ) as url:
        stuck = asyncio.ensure_future(post(http, url + "/v1/completions", COMPLETION, request_id="holder"))
        try:
            for _ in range(50):  # until the first request holds the only slot
                if rig.prefill.generations():
                    break
                await asyncio.sleep(0.02)
            async with http.post(url + "/v1/completions", data=orjson.dumps(COMPLETION),
                                 headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
                assert resp.status == 429
                assert int(resp.headers["Retry-After"]) >= 1
                assert "capacity" in orjson.loads(await resp.read())["error"]["message"]
        finally:
            stuck.cancel()


async def test_metrics_and_ledger_account_for_every_handoff(rig: Rig, http: aiohttp.ClientSession) -> None:
    with running_proxy([rig.prefill_url], [rig.decode_url], api_keys=ApiKeys(admin="admin-secret")) as url:
        assert (await post(http, url + "/v1/completions", COMPLETION))[0] == 200
        # Refused by decode alone (min_tokens beyond the context the prompt leaves), after a prefill
        beyond_context = {**COMPLETION, "max_tokens": 2048, "min_tokens": 2048}
        assert (await post(http, url + "/v1/completions", beyond_context))[0] == 400
        status, ledger = await call(http, "GET", url + "/admin/ledger", headers=ADMIN)
        _, metrics = await call(http, "GET", url + "/metrics")
    assert status == 200
    assert (ledger["issued"], ledger["delivered"], ledger["abandoned"]) == (2, 1, {"decode_rejected": 1})
    assert ledger["open"] == []
    assert {h["state"] for h in ledger["recent"]} == {"delivered", "abandoned"}
    assert 'pdserve_kv_handoffs_total{state="delivered"} 1' in metrics
    assert 'pdserve_requests_total{endpoint="completions",outcome="ok"} 1' in metrics
    assert 'pdserve_requests_total{endpoint="completions",outcome="client_error"} 1' in metrics
    assert "pdserve_kv_handoffs_open 0" in metrics


async def test_client_leaving_between_phases_abandons_the_handoff(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    rig.decode.fault = "hang"
    with running_proxy([rig.prefill_url], [rig.decode_url], api_keys=ApiKeys(admin="admin-secret")) as url:
        request = asyncio.ensure_future(post(http, url + "/v1/completions", COMPLETION, request_id="leaver"))
        for _ in range(100):
            if rig.decode.generations():
                break
            await asyncio.sleep(0.02)
        request.cancel()
        for _ in range(100):
            _, ledger = await call(http, "GET", url + "/admin/ledger", headers=ADMIN)
            if ledger["abandoned"]:
                break
            await asyncio.sleep(0.02)
    assert ledger["abandoned"] == {"client_gone": 1}
    assert ledger["recent"][0]["request_id"] == "leaver"


async def test_pools_serving_different_models_are_refused_at_start(rig: Rig) -> None:
    other = FakeVLLM("decode", model="another-model")
    with serve_fake(other) as other_url:
        app = create_app(ProxyConfig.pd((rig.prefill_url,), (other_url,)))
        with pytest.raises(ConfigError, match="different models"):
            async with app.router.lifespan_context(app):
                pass
