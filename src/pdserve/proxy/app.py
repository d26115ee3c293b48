"""The proxy's ASGI application: ``create_app(config)`` wires upstreams, policies and routes.

Routes:
    POST /v1/completions, /v1/chat/completions   the PD flow (proxy/flow.py)
    GET  /v1/models                              a decode instance's answer
    GET  /health                                 200 when >= 1 prefill and >= 1 decode instance answer
    GET  /instances                              each instance's role, URL and health
    GET  /requests                               the last requests' walk-through (phases, params, errors)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve import protocol
from pdserve.config import ProxyConfig
from pdserve.errors import UpstreamError
from pdserve.protocol import Endpoint
from pdserve.proxy.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Responder,
    Scope,
    Send,
    header,
    read_body,
    run_until_disconnect,
)
from pdserve.proxy.flow import Flow
from pdserve.proxy.routing import make_policy
from pdserve.proxy.upstream import Upstream

log = logging.getLogger("pdserve.proxy")

_HEALTH_TIMEOUT = 2.0


class GenerationEndpoint:
    """ASGI app for one generation route: reads the body, runs the flow, cancels it on disconnect."""

    def __init__(self, flow: Flow, endpoint: Endpoint, max_body_bytes: int) -> None:
        self._flow = flow
        self._endpoint = endpoint
        self._max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = header(scope, b"x-request-id") or protocol.new_request_id()
        out = Responder(send, request_id)
        try:
            raw = await read_body(receive, self._max_body)
        except BodyTooLarge:
            await out.error(413, f"Request body exceeds {self._max_body} bytes", "BadRequestError")
            return
        except ClientGone:
            return
        work = self._flow.serve(self._endpoint, raw, header(scope, b"authorization"), out)
        try:
            if await run_until_disconnect(work, receive, out):
                log.info("request %s: client disconnected; upstream calls cancelled", request_id)
        except Exception:
            log.exception("request %s: internal error", request_id)
            await out.error(500, "pdserve internal error; see the proxy log", "InternalServerError")


async def _probe(upstream: Upstream) -> dict[str, Any]:
    try:
        reply = await upstream.get("/health", "health", _HEALTH_TIMEOUT)
    except UpstreamError as exc:
        return {"role": upstream.role, "url": upstream.url, "healthy": False, "error": exc.detail}
    healthy = reply.status == 200
    error = None if healthy else f"/health answered {reply.status}"
    return {"role": upstream.role, "url": upstream.url, "healthy": healthy, "error": error}


def create_app(config: ProxyConfig) -> Starlette:
    t = config.timeouts
    prefill = [
        Upstream("prefill", u, t.connect, config.max_connections_per_upstream) for u in config.prefill_urls
    ]
    decode = [
        Upstream("decode", u, t.connect, config.max_connections_per_upstream) for u in config.decode_urls
    ]
    upstreams: Sequence[Upstream] = (*prefill, *decode)
    flow = Flow(prefill, decode, make_policy(config.prefill_policy), make_policy(config.decode_policy), t)

    async def instances(_: Request) -> JSONResponse:
        return JSONResponse({"instances": list(await asyncio.gather(*map(_probe, upstreams)))})

    async def health(_: Request) -> JSONResponse:
        probes = await asyncio.gather(*map(_probe, upstreams))
        healthy_roles = {p["role"] for p in probes if p["healthy"]}
        ok = {"prefill", "decode"} <= healthy_roles
        body = {"status": "ok" if ok else "unavailable", "instances": probes}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(_: Request) -> Response:
        errors = []
        for upstream in decode:
            try:
                reply = await upstream.get("/v1/models", "models", t.connect + _HEALTH_TIMEOUT)
            except UpstreamError as exc:
                errors.append(str(exc))
                continue
            return Response(reply.body, status_code=reply.status, media_type=reply.content_type)
        message = "no decode instance answered /v1/models: " + "; ".join(errors)
        return Response(
            protocol.error_body(message, "upstream_unavailable", 502), 502, media_type="application/json"
        )

    async def requests(_: Request) -> JSONResponse:
        return JSONResponse({"requests": [trace.as_dict() for trace in flow.traces]})

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        for upstream in upstreams:
            await upstream.open()
        try:
            yield
        finally:
            await asyncio.gather(*(u.close() for u in upstreams))

    routes = [
        Route(
            "/v1/completions",
            GenerationEndpoint(flow, "completions", config.max_body_bytes),
            methods=["POST"],
        ),
        Route(
            "/v1/chat/completions", GenerationEndpoint(flow, "chat", config.max_body_bytes), methods=["POST"]
        ),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/instances", instances, methods=["GET"]),
        Route("/requests", requests, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.flow = flow
    return app
