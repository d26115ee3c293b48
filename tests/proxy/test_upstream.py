"""The HTTP client to instances: what its timeouts measure, and slow versus dead."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from proxy_rig import STRICT, TIMEOUTS, Rig, running_proxy
from test_flow import COMPLETION, post

from pdserve.proxy.pool.breaker import CircuitBreaker
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.wire.upstream import HTTPUpstream


async def test_waiting_for_a_pooled_connection_is_not_a_connect_timeout(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    rig.decode.fault = "hang"
    with running_proxy(
        [rig.prefill_url], [rig.decode_url], max_connections_per_upstream=1, retries=STRICT
    ) as url:
        first = asyncio.ensure_future(post(http, url + "/v1/completions", COMPLETION))
        await asyncio.sleep(0.3)  # the first request holds decode's only connection
        status, _, body = await post(http, url + "/v1/completions", COMPLETION)
        first.cancel()
    message = orjson.loads(body)["error"]["message"]
    # The second request waited longer than the connect timeout, but never tried to connect.
    assert status == 504, message
    assert "cannot connect" not in message and f"within {TIMEOUTS.decode:g} s" in message


def test_timeouts_do_not_open_an_instances_circuit_but_hard_failures_do() -> None:
    instance = Instance(HTTPUpstream("decode", "http://d:1", 1, 1), CircuitBreaker(threshold=2))
    for _ in range(5):
        instance.failed("no answer within 3 s", is_slow=True)
    assert instance.breaker.state(0) == "closed" and instance.last_error == "no answer within 3 s"
    instance.failed("answered 500")
    instance.failed("answered 500")
    assert instance.breaker.state(0) == "open"
