"""Where each millisecond goes: the timeline in /requests, pdserve_* histograms in /metrics, and
OpenTelemetry spans received by a real OTLP/HTTP endpoint, joined to the instances by traceparent."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from proxy_rig import Rig, running_proxy
from test_flow import COMPLETION, post

from otlp_receiver import otlp_receiver
from pdserve.prometheus import parse_prometheus


async def test_spans_of_a_request_reach_the_collector_and_the_instances_share_its_trace(
    rig: Rig, http: aiohttp.ClientSession
) -> None:
    with otlp_receiver() as receiver:
        with running_proxy([rig.prefill_url], [rig.decode_url], otlp_traces_endpoint=receiver.url) as url:
            for stream in (False, True):
                status, _, _ = await post(http, url + "/v1/completions", {**COMPLETION, "stream": stream},
                                          request_id=f"traced-{stream}")  # fmt: skip
                assert status == 200
        deadline = time.monotonic() + 10  # the proxy flushes its spans as it stops
        while len({s.trace_id for s in receiver.snapshot() if s.name.startswith("pdserve ")}) < 2:
            assert time.monotonic() < deadline, receiver.snapshot()
            await asyncio.sleep(0.1)
    spans = receiver.snapshot()
    for stream in (False, True):
        [root] = [s for s in spans if s.attributes.get("pdserve.request_id") == f"traced-{stream}"]
        children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
        assert {"queue", "prefill", "handoff_gap", "decode_first_byte"} <= set(children), children
        assert all(root.start_ns <= c.start_ns <= c.end_ns <= root.end_ns for c in children.values())
        assert root.attributes["pdserve.outcome"] == "ok"
        # Both instances were told the trace: vLLM's own spans become the request span's children.
        for fake in (rig.prefill, rig.decode):
            [seen] = [r for r in fake.generations() if r.headers.get("x-request-id") == f"traced-{stream}"]
            _version, trace_id, parent_id, _flags = seen.headers["traceparent"].split("-")
            assert (trace_id, parent_id) == (root.trace_id, root.span_id)


async def test_requests_show_each_phase_and_metrics_count_them(rig: Rig, http: aiohttp.ClientSession) -> None:
    rig.decode.fault = "trickle"  # chunks apart in time, so there are gaps between them
    status, _, _ = await post(http, rig.url + "/v1/completions", {**COMPLETION, "stream": True}, "timed")
    assert status == 200
    async with http.get(rig.url + "/requests") as resp:
        [trace] = [t for t in (await resp.json())["requests"] if t["request_id"] == "timed"]
    timeline = trace["timeline"]
    for phase in ("queue_ms", "prefill_ms", "handoff_gap_ms", "decode_first_byte_ms", "ttft_ms", "e2e_ms"):
        assert timeline[phase] >= 0, (phase, timeline)
    assert timeline["ttft_ms"] <= timeline["e2e_ms"]
    assert timeline["prefill_ms"] + timeline["decode_first_byte_ms"] <= timeline["ttft_ms"] + 1
    assert timeline["itl_max_ms"] >= timeline["itl_mean_ms"] >= 0
    async with http.get(rig.url + "/metrics") as resp:
        samples = parse_prometheus(await resp.text())
    for name in ("pdserve_prefill_seconds_count", "pdserve_ttft_seconds_count", "pdserve_itl_seconds_count"):
        assert samples[name] >= 1, name
