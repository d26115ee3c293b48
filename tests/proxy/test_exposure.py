"""Who may read what: the client key on every /v1/* route, /requests and the admin API behind the admin
key, instances named by pool name in what clients read, and request ids the proxy passes on bounded."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from proxy_rig import STRICT, Rig, running_proxy
from test_flow import COMPLETION

from pdserve.configparts import ApiKeys

KEYS = ApiKeys(client="client-secret", admin="admin-secret")


async def get(http: aiohttp.ClientSession, url: str, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.get(url, headers=headers) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("key", [None, "wrong", "admin-secret"], ids=["none", "wrong", "admin"])
async def test_models_needs_the_client_key_and_is_never_forwarded_without_it(
    rig: Rig, http: aiohttp.ClientSession, key: str | None
) -> None:
    with running_proxy([rig.prefill_url], [rig.decode_url], api_keys=KEYS) as url:
        await get(http, url + "/health")  # the proxy's own start-up check of /v1/models is over
        before = len([r for r in rig.decode.requests if r.path == "/v1/models"])
        status, body = await get(http, url + "/v1/models", key)
        after = len([r for r in rig.decode.requests if r.path == "/v1/models"])
        assert (await get(http, url + "/v1/models", "client-secret"))[0] == 200
    assert status == 401
    assert orjson.loads(body)["error"]["type"] == "AuthenticationError"
    assert after == before


@pytest.mark.parametrize("key", [None, "wrong", "client-secret"], ids=["none", "wrong", "client"])
async def test_requests_and_the_admin_api_need_the_admin_key(
    rig: Rig, http: aiohttp.ClientSession, key: str | None
) -> None:
    with running_proxy([rig.prefill_url], [rig.decode_url], api_keys=KEYS) as url:
        async with http.post(url + "/v1/completions", json=COMPLETION,
                             headers={"Authorization": "Bearer client-secret",
                                      "X-Request-Id": "tenantA-session-42"}) as resp:  # fmt: skip
            assert resp.status == 200
        refused = [await get(http, url + path, key) for path in ("/requests", "/requests?id=tenantA-session-42",
                                                                  "/admin/ledger", "/admin/instances")]  # fmt: skip
        status, shown = await get(http, url + "/requests?id=tenantA-session-42", "admin-secret")
    assert [s for s, _ in refused] == [401] * 4
    assert all(b"tenantA" not in body and b"kv_transfer_params" not in body for _, body in refused)
    assert status == 200 and b"tenantA-session-42" in shown


async def test_a_client_reads_instances_by_pool_name_and_operators_by_url(
    rig: Rig, http: aiohttp.ClientSession, dead_url: str
) -> None:
    with running_proxy([rig.prefill_url], [dead_url], retries=STRICT) as url:
        async with http.post(url + "/v1/completions", json=COMPLETION) as resp:
            status, body = resp.status, await resp.read()
        _, models = await get(http, url + "/v1/models")
        _, requests = await get(http, url + "/requests")
    assert status == 502
    assert b"decode-0" in body and dead_url.encode() not in body
    assert b"decode-0" in models and dead_url.encode() not in models
    assert dead_url.encode() in requests  # the operator's view keeps the URL


async def test_instance_urls_shown_to_clients_when_configured(
    rig: Rig, http: aiohttp.ClientSession, dead_url: str
) -> None:
    with running_proxy(
        [rig.prefill_url], [dead_url], api_keys=ApiKeys(show_instance_urls=True), retries=STRICT
    ) as url:
        async with http.post(url + "/v1/completions", json=COMPLETION) as resp:
            body = await resp.read()
    assert dead_url.encode() in body


@pytest.mark.parametrize("given", ["x" * 60_000, "a b", "id;drop", "ünï", "x" * 129, ""])
async def test_an_unusable_request_id_is_replaced_and_the_client_told(
    rig: Rig, http: aiohttp.ClientSession, given: str
) -> None:
    headers = {"X-Request-Id": given.encode("utf-8").decode("latin-1")}
    async with http.post(rig.url + "/v1/completions", json=COMPLETION, headers=headers) as resp:
        assert resp.status == 200
        used = resp.headers["X-Request-Id"]
        assert "1 to 128 of" in resp.headers["X-Request-Id-Replaced"]
    assert used != given and len(used) == 32
    [seen] = [r for r in rig.decode.generations()]
    assert seen.headers.get("x-request-id") == used


async def test_a_usable_request_id_goes_to_the_instances_as_it_is(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    given = "tenantA-session_42.7:" + "x" * 100
    async with http.post(
        rig.url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": given}
    ) as resp:
        assert resp.headers["X-Request-Id"] == given
        assert "X-Request-Id-Replaced" not in resp.headers
    [seen] = rig.decode.generations()
    assert seen.headers.get("x-request-id") == given
