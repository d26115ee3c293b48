"""The proxy's ASGI application: ``create_app(config)`` wires upstreams, policies and routes.

Routes:
    POST /v1/completions, /v1/chat/completions   the PD flow (proxy/flow.py)
    GET  /v1/models                              a decode instance's answer
    GET  /health                                 200 when >= 1 prefill and >= 1 decode instance can serve
    GET  /instances                              a JSON list: each instance's role, URL, health, circuit,
                                                 in-flight requests and engine load (checked on the spot)
    GET  /requests                               the last requests' walk-through (phases, params, errors)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve import protocol
from pdserve.config import ProxyConfig, Role
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
from pdserve.proxy.pool import CircuitBreaker, Instance, Pool
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


def _pool(role: Role, urls: Sequence[str], config: ProxyConfig) -> Pool:
    t = config.timeouts
    return Pool(
        role,
        [
            Instance(
                Upstream(role, url, t.connect, config.max_connections_per_upstream),
                CircuitBreaker(config.breaker_threshold, config.breaker_cooldown_s),
            )
            for url in urls
        ],
    )


def create_app(config: ProxyConfig) -> Starlette:
    t = config.timeouts
    prefill, decode = (
        _pool("prefill", config.prefill_urls, config),
        _pool("decode", config.decode_urls, config),
    )
    pools = (prefill, decode)
    flow = Flow(
        prefill, decode, make_policy(config.prefill_policy), make_policy(config.decode_policy), config
    )

    async def check_now() -> list[dict[str, object]]:
        await asyncio.gather(*(p.check_all(_HEALTH_TIMEOUT) for p in pools))
        return [i.describe() for p in pools for i in p.instances]

    async def instances(_: Request) -> JSONResponse:
        return JSONResponse(await check_now())

    async def health(_: Request) -> JSONResponse:
        described = await check_now()
        ok = all(p.available() for p in pools)
        body = {"status": "ok" if ok else "unavailable", "instances": described}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(_: Request) -> Response:
        errors = []
        for instance in decode.available() or decode.instances:
            try:
                reply = await instance.upstream.get("/v1/models", "models", t.connect + _HEALTH_TIMEOUT)
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

    async def health_loop() -> None:
        while True:
            await asyncio.sleep(config.health_interval_s)
            await asyncio.gather(*(p.check_all(_HEALTH_TIMEOUT) for p in pools))

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        upstreams = [i.upstream for p in pools for i in p.instances]
        for upstream in upstreams:
            await upstream.open()
        checker = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            checker.cancel()
            await asyncio.gather(checker, return_exceptions=True)
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
