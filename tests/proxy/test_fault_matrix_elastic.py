"""The fault matrix against an elastic pool: three sim instances of any role behind the real proxy, one
injected fault at a time, every request both streamed and whole, to completions and chat.

Each request gets a fresh proxy, whose router (no step costs: long prompts split, the two least-loaded
instances, ties in order) places it with decode on instance 0 and prefill on instance 1; the faults are
there. The survivors take every role, so a fault on one instance never reaches the client: a failed
prefill is retried on instance 2 or computed by the decode, a failed decode hands the request to
another instance. Only when every instance fails does the client get an error, and a clear one.
Afterwards no instance holds KV or runs a request, and the proxy's ledger has nothing open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from proxy_rig import TIMEOUTS, elastic_pool, running_proxy
from sim_matrix import (
    COMBOS,
    LEASE_S,
    PROFILE,
    SimPD,
    ask,
    proxy_json,
    settled,
    under_faults,
)

from pdserve.configparts import ApiKeys
from pdserve.protocol import Endpoint
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread

T = TIMEOUTS
SLACK_S = 2.5
QUICK_S = 0.5
MAX_TOKENS = 8
ADMIN_KEY = "matrix-admin"
LONG = "river " * 600  # the router's estimate: ~900 tokens, split (>= 512 with no step costs known)


@dataclass(frozen=True)
class Case:
    faults: dict[int, dict[str, Any]]  # instance index → fault fields
    kind: str  # how every request ends: ok, error (whole) / stream_error or error (streamed)
    within_s: float
    status: int = 200


CASES = [
    pytest.param(Case({1: {"error_rate": 1}}, "ok", QUICK_S), id="prefill-answers-500-another-prefills"),
    pytest.param(
        Case({1: {"hang_rate": 1}}, "ok", T.prefill), id="prefill-hangs-another-prefills-after-the-timeout"
    ),
    pytest.param(Case({1: {"down": True}}, "ok", QUICK_S), id="prefill-down-another-prefills"),
    pytest.param(Case({1: {"drop_rate": 1}}, "ok", QUICK_S), id="prefill-dies-mid-answer-another-prefills"),
    pytest.param(Case({0: {"error_rate": 1}}, "ok", QUICK_S), id="decode-answers-500-another-serves"),
    pytest.param(
        Case({0: {"hang_rate": 1}}, "ok", T.decode), id="decode-hangs-another-serves-after-the-timeout"
    ),
    pytest.param(Case({0: {"down": True}}, "ok", QUICK_S), id="decode-down-another-serves"),
    pytest.param(Case({0: {"pull_fail_rate": 1}}, "ok", QUICK_S), id="decode-cannot-pull-another-serves"),
    # Decode dies with the answer under way: a stream goes on from another instance (docs/migration.md).
    *(
        pytest.param(
            Case({0: {"drop_rate": 1, "drop_after_tokens": k}}, "ok", QUICK_S),
            id=f"decode-dies-after-{k}-tokens-another-goes-on",
        )
        for k in (1, MAX_TOKENS - 2)
    ),
    pytest.param(
        Case({1: {"down": True}, 2: {"down": True}}, "ok", QUICK_S), id="no-prefill-left-decode-computes"
    ),
    pytest.param(
        Case({i: {"error_rate": 1} for i in range(3)}, "error", QUICK_S, 500), id="every-instance-answers-500"
    ),
]


@pytest.fixture(scope="module")
def pool() -> Iterator[SimPD]:
    with sim_in_thread([SimInstanceSpec("both")] * 3, PROFILE) as cluster:
        yield SimPD((), tuple(cluster.urls))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.mark.parametrize("case", CASES)
async def test_every_request_is_served_while_an_instance_can_serve_it(
    case: Case, pool: SimPD, http: aiohttp.ClientSession
) -> None:
    with ExitStack() as proxies:
        urls = [
            proxies.enter_context(
                running_proxy(
                    pools=elastic_pool(pool.decode), kv_lease_s=LEASE_S, api_keys=ApiKeys(admin=ADMIN_KEY)
                )
            )
            for _ in COMBOS
        ]
        faults = {pool.decode[index]: fault for index, fault in case.faults.items()}

        async def one(url: str, endpoint: Endpoint, stream: bool) -> list[str]:
            return await _ask(http, url, case, endpoint, stream)

        problems = await under_faults(http, urls, faults, pool.decode, one)
    ended = time.monotonic()
    assert not [p for ps in problems for p in ps], "\n".join(p for ps in problems for p in ps)
    await settled(http, pool, LEASE_S + SLACK_S - (time.monotonic() - ended))


async def _ask(
    http: aiohttp.ClientSession, url: str, case: Case, endpoint: Endpoint, stream: bool
) -> list[str]:
    request_id = f"elastic-{endpoint}-{'streamed' if stream else 'whole'}-{time.monotonic_ns()}"
    answer = await ask(http, url, endpoint, stream, request_id, MAX_TOKENS, case.within_s + SLACK_S + 5, LONG)
    mode = f"{endpoint} {'streamed' if stream else 'whole'}"
    expected = case.kind
    if case.kind == "error" and stream:
        expected = "error"  # every decode refuses before a byte: a JSON error, not a stream
    problems = []
    if answer.kind != expected:
        problems.append(
            f"{mode}: ended {answer.kind} ({answer.status}: {answer.detail}), expected {expected}"
        )
    elif expected == "error" and answer.status != case.status:
        problems.append(f"{mode}: status {answer.status}, expected {case.status} ({answer.detail})")
    if answer.elapsed_s > case.within_s + SLACK_S:
        problems.append(f"{mode}: took {answer.elapsed_s:.2f} s, bound {case.within_s + SLACK_S:g} s")
    [trace] = [
        t
        for t in (await proxy_json(http, url + "/requests", ADMIN_KEY))["requests"]
        if t["request_id"] == request_id
    ]
    placement = trace["placement"]
    if not placement["split"] or placement["decode_url"] != await _first(http, url):
        problems.append(f"{mode}: the router did not place it as the case expects: {placement}")
    ledger = await proxy_json(http, url + "/admin/ledger", ADMIN_KEY)
    if ledger["open"] and answer.kind == "ok":
        await asyncio.sleep(1.0)  # the last handoff may close just after the answer ends
        ledger = await proxy_json(http, url + "/admin/ledger", ADMIN_KEY)
    if ledger["open"]:
        problems.append(f"{mode}: proxy ledger has open handoffs: {ledger['open']}")
    return problems


async def _first(http: aiohttp.ClientSession, url: str) -> str:
    return str((await proxy_json(http, url + "/instances", ADMIN_KEY))[0]["url"])
