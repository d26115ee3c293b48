"""Tracing on real vLLM: a request through the proxy is one trace, the proxy's span with vLLM's own spans
from prefill and decode under it, as `pdserve up --otlp-traces-endpoint URL` promises.

It reuses the session pair, which conftest.py starts with tracing on (the proxy's endpoint, passed on
by ``Stack`` to every instance, as `up` does): a pair of its own would add 70-90 s and ~5 GB to a 2-core
CI run for what one request on the running pair shows. The cost is that the other e2e tests run beside
a live exporter; vLLM's tracing adds one span per finished request, and the untraced paths still run
on real vLLM (test_bench_vllm's own pair, the proxies test_pd and test_doctor_vllm start). CPU only:
conftest.py's ``otlp`` says why.
"""

from __future__ import annotations

import uuid

import openai
import pytest

from otlp_receiver import ReceivedSpan, Receiver
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
# vLLM's exporter batches every 5 s (BatchSpanProcessor's default); a busy 2-core machine adds to it.
SPANS_WITHIN_S = 30.0


def _vllm_span(spans: list[ReceivedSpan], service: str, request_id: str) -> ReceivedSpan | None:
    found = [
        s for s in spans if s.service == service and request_id in str(s.attributes.get("gen_ai.request.id"))
    ]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_vllm_spans_of_prefill_and_decode_join_the_proxys_trace(
    stack: Stack, otlp: Receiver, client: openai.OpenAI, model_name: str
) -> None:
    assert stack.topology.otlp_traces_endpoint == otlp.url  # the instances were told, not only the proxy
    request_id = f"traced-{uuid.uuid4().hex[:8]}"
    prompt = f"{request_id}: the ferry left the harbour at dawn and"
    resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_headers={"X-Request-Id": request_id})  # fmt: skip
    assert resp.choices[0].text

    def complete(spans: list[ReceivedSpan]) -> bool:
        has_root = any(s.attributes.get("pdserve.request_id") == request_id for s in spans)
        instances = ("vllm-prefill-0", "vllm-decode-0")
        return has_root and all(_vllm_span(spans, i, request_id) for i in instances)

    spans = otlp.wait_for(complete, SPANS_WITHIN_S)
    [root] = [s for s in spans if s.attributes.get("pdserve.request_id") == request_id]
    assert root.service == "pdserve-proxy"
    prefill = _vllm_span(spans, "vllm-prefill-0", request_id)
    decode = _vllm_span(spans, "vllm-decode-0", request_id)
    assert prefill is not None and decode is not None
    for span in (prefill, decode):
        # One trace in the viewer: vLLM's request span hangs under the proxy's, by the traceparent it sent.
        assert (span.trace_id, span.parent_span_id) == (root.trace_id, root.span_id), (span, root)
        assert span.name == "llm_request"
    # Each instance's span tells its part: prefill computed the prompt for 1 token, decode generated the
    # answer on the same prompt, after prefill was done with it.
    assert prefill.attributes["gen_ai.request.max_tokens"] == 1, prefill.attributes
    assert decode.attributes["gen_ai.request.max_tokens"] == MAX_TOKENS, decode.attributes
    assert resp.usage is not None
    assert decode.attributes["gen_ai.usage.completion_tokens"] == resp.usage.completion_tokens
    assert prefill.attributes["gen_ai.usage.prompt_tokens"] == decode.attributes["gen_ai.usage.prompt_tokens"]
    in_order = (root.start_ns, prefill.start_ns, prefill.end_ns, decode.start_ns, decode.end_ns, root.end_ns)
    assert list(in_order) == sorted(in_order), (root, prefill, decode)
