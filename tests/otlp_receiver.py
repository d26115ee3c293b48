"""An in-process OTLP/HTTP trace receiver: what a collector would get from the proxy and the instances,
decoded. Shared by tests/proxy (the proxy's spans) and tests/e2e (vLLM's own spans joining them)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporter's resource service.name: "pdserve-proxy", "vllm-prefill-0", …
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

    def wait_for(self, found: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        """The spans received once ``found`` holds for them; fails, showing them, after ``timeout_s``.
        Exporters batch (vLLM's every 5 s, the proxy's every 0.5 s), so spans arrive a while after
        the request that made them."""
        deadline = time.monotonic() + timeout_s
        while not found(spans := self.snapshot()):
            assert time.monotonic() < deadline, f"not received within {timeout_s} s: {spans}"
            time.sleep(0.1)
        return spans


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(any_value, kind) if kind else None


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()

    async def traces(request: Request) -> Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.body())
        found = []
        for resource in export.resource_spans:
            resource_attributes = {a.key: _value(a.value) for a in resource.resource.attributes}
            service = str(resource_attributes.get("service.name", ""))
            found += [
                ReceivedSpan(
                    service,
                    span.name,
                    span.trace_id.hex(),
                    span.span_id.hex(),
                    span.parent_span_id.hex(),
                    span.start_time_unix_nano,
                    span.end_time_unix_nano,
                    {a.key: _value(a.value) for a in span.attributes},
                )
                for scope in resource.scope_spans
                for span in scope.spans
            ]
        with receiver.lock:
            receiver.spans.extend(found)
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", lifespan="off"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # listening before the thread starts: exporters may send at once
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/traces"
    try:
        yield receiver
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
