"""The proxy's routes besides generation: models, health, instances, the request walk-through, limits."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import aiohttp
import openai
import orjson
import pytest
from fake_vllm import MODEL
from memory_upstream import Answer, MemoryUpstream, Recorder
from proxy_rig import NO_BREAKER, Rig, running_proxy

from pdserve.config import ProxyConfig, Role
from pdserve.configparts import AdmissionLimits, HealthChecks
from pdserve.proxy.serving.app import create_app
from pdserve.proxy.wire.upstream import Reply, Stream


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_models_is_decodes_answer(rig: Rig, http: aiohttp.ClientSession) -> None:
    status, through_proxy = await get_json(http, rig.url + "/v1/models")
    assert status == 200
    _, direct = await get_json(http, rig.decode_url + "/v1/models")
    assert through_proxy == direct
    assert [m["id"] for m in through_proxy["data"]] == [MODEL]
    # Besides our direct call, the decode saw the proxy's (the fakes also see the proxy's own checks).
    assert len([r for r in rig.decode.requests if r.path == "/v1/models"]) >= 2


async def test_models_answers_502_when_no_decode_answers(
    rig: Rig, http: aiohttp.ClientSession, dead_url: str
) -> None:
    with running_proxy([rig.prefill_url], [dead_url]) as url:
        status, body = await get_json(http, url + "/v1/models")
    assert status == 502
    assert "decode-0" in body["error"]["message"] and dead_url not in body["error"]["message"]


async def test_health_is_200_when_prefill_and_decode_answer(rig: Rig, http: aiohttp.ClientSession) -> None:
    status, body = await get_json(http, rig.url + "/health")
    assert status == 200
    assert body["status"] == "ok"


async def test_health_is_503_naming_the_dead_instance(
    rig: Rig, http: aiohttp.ClientSession, dead_url: str
) -> None:
    with running_proxy(
        [rig.prefill_url], [dead_url], health=dataclasses.replace(NO_BREAKER, interval_s=0.2)
    ) as url:
        deadline = time.monotonic() + 5  # /health reports what the health checks last saw
        status, body = await get_json(http, url + "/health")
        while status == 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            status, body = await get_json(http, url + "/health")
    assert status == 503
    assert body["status"] == "unavailable"
    [dead] = [i for i in body["instances"] if not i["healthy"]]
    assert (dead["role"], dead["url"]) == ("decode", dead_url)
    assert "cannot connect" in dead["error"]


@dataclass
class _CountingUpstream(MemoryUpstream):
    """Records every GET and POST the proxy makes to the instance."""

    asked: list[str] = field(default_factory=list)

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        self.asked.append(f"GET {path}")
        return await super().get(path, phase, timeout)

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float,
        is_repeatable: bool = False,
    ) -> Reply:  # fmt: skip
        self.asked.append(f"POST {path}")
        return await super().post(path, body, headers, phase, timeout, is_repeatable)

    def open_stream(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> AbstractAsyncContextManager[Stream]:
        self.asked.append(f"POST {path} (streamed)")
        return super().open_stream(path, body, headers, phase, timeout)


async def test_health_and_instances_only_read_what_the_health_checks_last_saw() -> None:
    upstreams: list[_CountingUpstream] = []

    def make(role: Role, url: str) -> _CountingUpstream:
        upstreams.append(_CountingUpstream(role, url, lambda body: Answer()))
        return upstreams[-1]

    # A check interval longer than the test: the health checker makes no call while the reads run.
    app = create_app(
        ProxyConfig.pd(("http://p0:1",), ("http://d0:1",), health=HealthChecks(interval_s=3600)), make
    )
    async with app.router.lifespan_context(app):
        for upstream in upstreams:
            upstream.asked.clear()  # the start-up model check asked /v1/models
        for path in ("/health", "/instances") * 3:
            send = Recorder()

            async def receive() -> dict[str, object]:
                return {"type": "http.request", "body": b"", "more_body": False}

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                     "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                     "root_path": "", "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}  # fmt: skip
            await app(scope, receive, send)
            assert send.status == 200, (path, send.body)
    assert len(upstreams) == 2
    assert [u.asked for u in upstreams] == [[], []]


async def test_instances_lists_role_url_and_health(rig: Rig, http: aiohttp.ClientSession) -> None:
    status, body = await get_json(http, rig.url + "/instances")
    assert status == 200
    keys = ("role", "url", "healthy", "circuit", "error")
    assert [{k: i[k] for k in keys} for i in body] == [
        {"role": "prefill", "url": rig.prefill_url, "healthy": True, "circuit": "closed", "error": None},
        {"role": "decode", "url": rig.decode_url, "healthy": True, "circuit": "closed", "error": None},
    ]
    assert all(i["in_flight"] == 0 and i["draining"] is False for i in body)


async def test_requests_shows_the_last_requests_phases(
    rig: Rig, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, extra_headers={"X-Request-Id": "walk-through"}
    )
    status, body = await get_json(http, rig.url + "/requests")
    assert status == 200
    last = body["requests"][-1]
    assert last["request_id"] == "walk-through"
    assert (last["endpoint"], last["stream"]) == ("completions", False)
    assert (last["prefill_url"], last["prefill_status"]) == (rig.prefill_url, 200)
    assert last["kv_transfer_params"] == rig.prefill.issued_kv_params[0]
    assert (last["decode_url"], last["decode_status"]) == (rig.decode_url, 200)
    assert last["local_prefill_reason"] is None
    assert last["error"] is None
    assert 0 < last["prefill_ms"] <= last["total_ms"]


async def test_requests_records_a_streamed_error_event(
    rig: Rig, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    rig.decode.fault = "error_event"
    stream = await client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, stream=True, extra_headers={"X-Request-Id": "failed-pull"}
    )
    try:
        async for _ in stream:
            pass
    except openai.APIError:
        pass
    _, body = await get_json(http, rig.url + "/requests")
    last = body["requests"][-1]
    assert last["request_id"] == "failed-pull"
    assert last["stream_error_event"] is True
    assert last["error"] == "decode streamed an error event"


async def test_requests_records_why_a_request_was_not_split(
    rig: Rig, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=2)
    _, body = await get_json(http, rig.url + "/requests")
    last = body["requests"][-1]
    assert last["local_prefill_reason"] == "n > 1"
    assert last["prefill_url"] is None
    assert last["kv_transfer_params"] is None


async def test_body_over_max_body_bytes_is_rejected_with_413(rig: Rig, http: aiohttp.ClientSession) -> None:
    limit = 1024
    at_limit = orjson.dumps({"model": MODEL, "max_tokens": 2, "prompt": ""})
    at_limit = at_limit.replace(b'"prompt":""', b'"prompt":"' + b"x" * (limit - len(at_limit)) + b'"')
    assert len(at_limit) == limit
    over_limit = at_limit.replace(b'"prompt":"', b'"prompt":"x')
    headers = {"Content-Type": "application/json"}
    with running_proxy(
        [rig.prefill_url], [rig.decode_url], admission=AdmissionLimits(max_body_bytes=limit)
    ) as url:
        async with http.post(url + "/v1/completions", data=over_limit, headers=headers) as resp:
            assert resp.status == 413
            assert orjson.loads(await resp.read())["error"]["code"] == 413
        assert rig.prefill.generations() == []
        assert rig.decode.generations() == []
        async with http.post(url + "/v1/completions", data=at_limit, headers=headers) as resp:
            assert resp.status == 200


async def test_requests_records_an_instances_rejection_as_the_error(
    rig: Rig, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="Hello", max_tokens=3)
    _, body = await get_json(http, rig.url + "/requests")
    assert body["requests"][-1]["error"] == "prefill answered 404"

    rig.decode.fault = "fail"
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=stream)
        _, body = await get_json(http, rig.url + "/requests")
        assert body["requests"][-1]["error"] == "decode answered 500"


async def test_requests_can_be_asked_for_one_request_by_id(rig: Rig, http: aiohttp.ClientSession) -> None:
    for rid in ("wanted", "other"):
        async with http.post(rig.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                             headers={"X-Request-Id": rid}) as resp:  # fmt: skip
            assert resp.status == 200
    status, body = await get_json(http, rig.url + "/requests?id=wanted")
    assert status == 200 and [t["request_id"] for t in body["requests"]] == ["wanted"]


async def test_generation_routes_answer_other_methods_as_before(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    # POSTs to the generation routes skip Starlette (ProxyApp); everything else still goes through it.
    async with http.get(rig.url + "/v1/completions") as resp:
        assert resp.status == 405
    async with http.post(rig.url + "/v1/nothing-here", data=b"{}") as resp:
        assert resp.status == 404


async def test_request_ids_are_unique_32_hex_digits(rig: Rig, http: aiohttp.ClientSession) -> None:
    ids = set()
    for _ in range(3):
        async with http.post(
            rig.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        ) as resp:
            assert resp.status == 200
            ids.add(resp.headers["x-request-id"])
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
