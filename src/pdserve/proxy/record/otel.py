"""OpenTelemetry spans of each request, exported over OTLP/HTTP, and the W3C ``traceparent`` that makes
the instances' own spans (vLLM with ``--otlp-traces-endpoint``) join the same trace.

One span per request lives while it is served: its context goes to prefill and decode in the
``traceparent`` header, so vLLM's spans become its children. The phases (queue, prefill, handoff gap,
decode first byte, stream) are recorded as child spans when the request ends, from its ``Timeline``:
nothing is built per chunk. Without an endpoint configured there is no tracer at all, and the request
path skips every call here. The only module that imports opentelemetry.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.proxy.record.timeline import Timeline

_PHASE_SPANS = (
    ("queue", "arrived", "admitted"),
    ("prefill", "prefill_sent", "prefill_done"),
    ("handoff_gap", "prefill_done", "decode_sent"),
    ("decode_first_byte", "decode_sent", "decode_first_byte"),
    ("stream", "first_byte", "ended"),
)


class RequestTracing:
    """The proxy's tracer: spans to ``endpoint`` (an OTLP/HTTP traces URL, e.g. http://host:4318/v1/traces)."""

    def __init__(self, endpoint: str, service_name: str = "pdserve-proxy") -> None:
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        # Short delay: a span should reach the collector while someone is still looking at the request.
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5), schedule_delay_millis=500)
        )
        self._tracer = self._provider.get_tracer("pdserve.proxy")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, request_id: str, endpoint: str, is_stream: bool, arrived_ns: int) -> Span:
        return self._tracer.start_span(
            f"pdserve {endpoint}",
            kind=SpanKind.SERVER,
            start_time=arrived_ns,
            attributes={
                "pdserve.request_id": request_id,
                "pdserve.endpoint": endpoint,
                "pdserve.stream": is_stream,
            },
        )

    def inject(self, span: Span, headers: MutableMapping[str, str]) -> None:
        """``traceparent`` (and ``tracestate``) for the instances, naming the request's span."""
        self._propagator.inject(headers, context=trace.set_span_in_context(span))

    def finish(
        self, span: Span, timeline: Timeline, arrived_ns: int, attributes: dict[str, Any], error: str | None
    ) -> None:
        """Record the phases as children of ``span`` and end it."""
        parent = trace.set_span_in_context(span)

        def ns(t: float) -> int:
            return arrived_ns + int((t - timeline.arrived) * 1e9)

        for name, start_field, end_field in _PHASE_SPANS:
            start, end = getattr(timeline, start_field), getattr(timeline, end_field)
            if start is None or end is None:
                continue
            kind = SpanKind.CLIENT if name in ("prefill", "decode_first_byte") else SpanKind.INTERNAL
            child = self._tracer.start_span(name, context=parent, kind=kind, start_time=ns(start))
            child.end(end_time=ns(end))
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=ns(timeline.ended) if timeline.ended is not None else None)

    def shutdown(self) -> None:
        self._provider.shutdown()


def epoch_ns() -> int:
    return time.time_ns()
