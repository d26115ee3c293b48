"""An in-process OTLP/HTTP trace receiver: what a collector would get from the proxy, decoded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from proxy_rig import listening_socket, serve_in_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]


@dataclass
class Receiver:
    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(any_value, kind) if kind else None


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()

    async def traces(request: Request) -> Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.body())
        found = [
            ReceivedSpan(
                span.name,
                span.trace_id.hex(),
                span.span_id.hex(),
                span.parent_span_id.hex(),
                span.start_time_unix_nano,
                span.end_time_unix_nano,
                {a.key: _value(a.value) for a in span.attributes},
            )
            for resource in export.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with receiver.lock:
            receiver.spans.extend(found)
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
    config = uvicorn.Config(app, log_config=None, log_level="warning", lifespan="off")
    with serve_in_thread(uvicorn.Server(config), listening_socket()) as url:
        receiver.url = url + "/v1/traces"
        yield receiver
