"""Kubernetes discovery end to end: pods on a mock API server, a real proxy watching it through
lightkube, and simulated vLLM instances at the pods' addresses. Everything is judged where a user looks:
the proxy's GET /instances, and requests served through it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import kmock
import orjson
from k8s_rig import Cluster, discovering_proxy, free_ports

from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread
from pdserve.sim.profile import Profile, load_profile
from pdserve.sim.types import SimRole

# Each decode step takes a while, so a long answer is still streaming when its pod starts terminating.
PROFILE = dataclasses.replace(load_profile("zero"), name="k8s", step_base_s=0.01)
COMPLETION = {"model": "sim-model", "prompt": "the pods come and go", "max_tokens": 8}


@contextmanager
def sims(*specs: tuple[SimRole, str, int], profile: Profile = PROFILE) -> Iterator[None]:
    """Simulated instances (role, host, port): what runs in the pods."""
    with sim_in_thread([SimInstanceSpec(role, host, port) for role, host, port in specs], profile):
        yield


async def instances(http: aiohttp.ClientSession, proxy: str) -> dict[str, dict[str, Any]]:
    async with http.get(proxy + "/instances") as resp:
        assert resp.status == 200
        return {i["url"]: i for i in orjson.loads(await resp.read())}


async def eventually(
    http: aiohttp.ClientSession, proxy: str, check: Callable[[dict[str, dict[str, Any]]], bool], what: str
) -> dict[str, dict[str, Any]]:
    """Polls /instances until ``check`` holds (discovery passes every second; 15 s is plenty)."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(150):
        seen = await instances(http, proxy)
        if check(seen):
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"never saw {what}; /instances: {seen}")


async def complete(http: aiohttp.ClientSession, proxy: str) -> tuple[int, dict[str, Any]]:
    async with http.post(proxy + "/v1/completions", json=COMPLETION) as resp:
        return resp.status, orjson.loads(await resp.read())


async def served_by(http: aiohttp.ClientSession, proxy: str) -> tuple[str | None, str | None]:
    """The prefill and decode URLs of the last request the proxy served (GET /requests)."""
    async with http.get(proxy + "/requests") as resp:
        last = orjson.loads(await resp.read())["requests"][-1]
        return last["prefill_url"], last["decode_url"]


async def test_ready_pods_join_the_pools_and_serve_requests(
    cluster: Cluster, api_server: str, http: aiohttp.ClientSession
) -> None:
    p, d = free_ports(2)
    with (
        sims(("prefill", "127.0.0.1", p), ("decode", "127.0.0.1", d)),
        discovering_proxy(api_server) as proxy,
    ):
        await cluster.create_pod("prefill-0", "prefill", "127.0.0.1", p)
        await cluster.create_pod("decode-0", "decode", "127.0.0.1", d)
        await asyncio.sleep(1.5)  # more than a discovery pass: pods that are not Ready stay out
        assert await instances(http, proxy) == {}
        async with http.get(proxy + "/health") as resp:
            assert resp.status == 503

        await cluster.set_ready("prefill-0", True)
        await cluster.set_ready("decode-0", True)
        seen = await eventually(http, proxy, lambda s: len(s) == 2, "both pods")
        assert {u: i["role"] for u, i in seen.items()} == {
            f"http://127.0.0.1:{p}": "prefill",
            f"http://127.0.0.1:{d}": "decode",
        }
        status, body = await complete(http, proxy)
        assert status == 200 and body["choices"][0]["text"]
        assert await served_by(http, proxy) == (f"http://127.0.0.1:{p}", f"http://127.0.0.1:{d}")


async def test_a_pod_that_stops_being_ready_leaves_and_comes_back(
    cluster: Cluster, api_server: str, http: aiohttp.ClientSession
) -> None:
    p, d = free_ports(2)
    prefill_url = f"http://127.0.0.1:{p}"
    with (
        sims(("prefill", "127.0.0.1", p), ("decode", "127.0.0.1", d)),
        discovering_proxy(api_server) as proxy,
    ):
        await cluster.create_pod("prefill-0", "prefill", "127.0.0.1", p, ready=True)
        await cluster.create_pod("decode-0", "decode", "127.0.0.1", d, ready=True)
        await eventually(http, proxy, lambda s: len(s) == 2, "both pods")

        await cluster.set_ready("prefill-0", False)  # e.g. its readiness probe failing
        await eventually(http, proxy, lambda s: prefill_url not in s, "the prefill pod taken out")
        status, body = await complete(http, proxy)
        assert status == 200, body  # no prefill in service: decode computes the prompt itself

        await cluster.set_ready("prefill-0", True)
        await eventually(http, proxy, lambda s: s.get(prefill_url, {}).get("state") == "serving", "it back")
        assert (await complete(http, proxy))[0] == 200


async def test_a_deleted_pod_drains_its_requests_then_leaves(
    cluster: Cluster, api_server: str, http: aiohttp.ClientSession
) -> None:
    p, d1, d2 = free_ports(3)
    old, new = f"http://127.0.0.1:{d1}", f"http://127.0.0.1:{d2}"
    specs = (("prefill", "127.0.0.1", p), ("decode", "127.0.0.1", d1), ("decode", "127.0.0.1", d2))
    with sims(*specs), discovering_proxy(api_server) as proxy:
        await cluster.create_pod("prefill-0", "prefill", "127.0.0.1", p, ready=True)
        await cluster.create_pod("decode-0", "decode", "127.0.0.1", d1, ready=True)
        await eventually(http, proxy, lambda s: len(s) == 2, "both pods")

        # A long streamed answer on decode-0 (300 steps of 10 ms), then decode-0 is deleted under it.
        body = {**COMPLETION, "max_tokens": 300, "stream": True}
        async with http.post(proxy + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # its first token is out
            await cluster.create_pod("decode-1", "decode", "127.0.0.1", d2, ready=True)
            await eventually(http, proxy, lambda s: new in s, "the second decode pod")
            await cluster.delete("decode-0")
            seen = await eventually(http, proxy, lambda s: s[old]["state"] == "draining", "decode-0 draining")
            assert seen[old]["in_flight"] == 1
            for _ in range(2):  # new requests go to the other decode pod only
                assert (await complete(http, proxy))[0] == 200
                assert (await served_by(http, proxy))[1] == new
            rest = await resp.read()
        assert rest.rstrip().endswith(b"data: [DONE]")  # the drained request finished whole

        await cluster.finish_deleting("decode-0")
        await eventually(http, proxy, lambda s: old not in s and new in s, "decode-0 gone")


async def test_a_pod_recreated_at_a_new_ip_replaces_its_old_url(
    cluster: Cluster, api_server: str, http: aiohttp.ClientSession
) -> None:
    # Same pod name, same port, another address: as a StatefulSet's pod rescheduled on another node.
    p, d = free_ports(2, "127.0.0.1", "127.0.0.2")
    specs = (("prefill", "127.0.0.1", p), ("prefill", "127.0.0.2", p), ("decode", "127.0.0.1", d))
    with sims(*specs), discovering_proxy(api_server) as proxy:
        await cluster.create_pod("prefill-0", "prefill", "127.0.0.1", p, ready=True)
        await cluster.create_pod("decode-0", "decode", "127.0.0.1", d, ready=True)
        await eventually(http, proxy, lambda s: f"http://127.0.0.1:{p}" in s and len(s) == 2, "both pods")

        await cluster.move("prefill-0", "127.0.0.2")
        seen = await eventually(
            http,
            proxy,
            lambda s: set(s) == {f"http://127.0.0.2:{p}", f"http://127.0.0.1:{d}"},
            "the new IP only",
        )
        assert seen[f"http://127.0.0.2:{p}"]["role"] == "prefill"
        assert (await complete(http, proxy))[0] == 200
        assert (await served_by(http, proxy))[0] == f"http://127.0.0.2:{p}"


async def test_pods_outside_the_selectors_are_ignored_though_the_server_sends_them(
    cluster: Cluster, api_server: str, http: aiohttp.ClientSession, kmock: kmock.KubernetesEmulator
) -> None:
    p, d, other = free_ports(3)
    specs = (("prefill", "127.0.0.1", p), ("decode", "127.0.0.1", d), ("decode", "127.0.0.1", other))
    with sims(*specs), discovering_proxy(api_server) as proxy:
        await cluster.create_pod("prefill-0", "prefill", "127.0.0.1", p, ready=True)
        await cluster.create_pod("decode-0", "decode", "127.0.0.1", d, ready=True)
        # Another app's pod: kmock lists and streams it to every watch, as a server ignoring selectors.
        await cluster.create_pod("other-0", "decode", "127.0.0.1", other, ready=True, labels={"app": "other"})
        await eventually(http, proxy, lambda s: len(s) == 2, "both pods")
        await asyncio.sleep(1.5)
        assert f"http://127.0.0.1:{other}" not in await instances(http, proxy)
    # ... and the selectors were sent all the same, for servers that do honour them.
    sent = {r.params.get("labelSelector") for r in kmock if r.resource is not None and r.method == "GET"}
    assert sent == {
        "app.kubernetes.io/name=pdserve,llm-d.ai/role=prefill",
        "app.kubernetes.io/name=pdserve,llm-d.ai/role=decode",
    }


async def test_a_pod_serving_another_model_is_refused(
    cluster: Cluster, api_server: str, http: aiohttp.ClientSession
) -> None:
    p, d, stranger = free_ports(3)
    other_model = dataclasses.replace(PROFILE, served_model_name="another-model")
    with (
        sims(("prefill", "127.0.0.1", p), ("decode", "127.0.0.1", d)),
        sims(("decode", "127.0.0.1", stranger), profile=other_model),
        discovering_proxy(api_server) as proxy,
    ):
        await cluster.create_pod("prefill-0", "prefill", "127.0.0.1", p, ready=True)
        await cluster.create_pod("decode-0", "decode", "127.0.0.1", d, ready=True)
        await eventually(http, proxy, lambda s: len(s) == 2, "both pods")
        await cluster.create_pod("decode-1", "decode", "127.0.0.1", stranger, ready=True)
        await asyncio.sleep(2.5)
        assert f"http://127.0.0.1:{stranger}" not in await instances(http, proxy)
