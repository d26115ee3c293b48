"""The proxy's ASGI application: ``create_app(config)`` wires pools, policies, admission and routes.

Routes:
    POST /v1/completions, /v1/chat/completions   the PD flow (proxy/flow.py), behind the API key
                                                 and admission control when configured
    GET  /v1/models                              a decode instance's answer
    GET  /health                                 200 when >= 1 prefill and >= 1 decode instance can serve
    GET  /instances                              a JSON list: each instance's role, URL, health, circuit,
                                                 in-flight requests and engine load (checked on the spot)
    GET  /requests                               the last requests' walk-through (admin key if set)
    GET  /metrics                                the proxy's Prometheus metrics (proxy/metrics.py)
    /admin/...                                   pools and KV ledger (proxy/admin.py)
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve import protocol
from pdserve.config import ProxyConfig, Role
from pdserve.errors import ConfigError, UpstreamError
from pdserve.protocol import Endpoint
from pdserve.proxy.admin import admin_routes, error_response, is_authorized
from pdserve.proxy.admission import Admission, Overloaded
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
from pdserve.proxy.metrics import render as render_metrics
from pdserve.proxy.pool import CircuitBreaker, Instance, Pool
from pdserve.proxy.routing import PolicyOptions, make_policy
from pdserve.proxy.tokens import PromptTokenizer
from pdserve.proxy.upstream import Upstream

log = logging.getLogger("pdserve.proxy")


class GenerationEndpoint:
    """ASGI app for one generation route: reads the body, runs the flow, cancels it on disconnect."""

    def __init__(self, flow: Flow, endpoint: Endpoint, config: ProxyConfig, admission: Admission) -> None:
        self._flow = flow
        self._endpoint = endpoint
        self._config = config
        self._admission = admission
        self._expected_auth = f"Bearer {config.api_key}".encode() if config.api_key else None
        self._upstream_auth = f"Bearer {config.upstream_api_key}" if config.upstream_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = header(scope, b"x-request-id") or protocol.new_request_id()
        out = Responder(send, request_id)
        auth = header(scope, b"authorization")
        if self._expected_auth is not None:
            if not hmac.compare_digest((auth or "").encode("latin-1"), self._expected_auth):
                await out.error(
                    401, "Invalid or missing API key (Authorization: Bearer ...)", "AuthenticationError"
                )
                return
            auth = None  # the proxy's key is not the instances' key
        auth = self._upstream_auth or auth
        max_body = self._config.max_body_bytes
        try:
            raw = await read_body(receive, max_body)
        except BodyTooLarge:
            await out.error(413, f"Request body exceeds {max_body} bytes", "BadRequestError")
            return
        except ClientGone:
            return
        try:
            async with self._admission.slot():
                work = self._flow.serve(self._endpoint, raw, auth, out)
                if await run_until_disconnect(work, receive, out):
                    log.info("request %s: client disconnected; upstream calls cancelled", request_id)
        except Overloaded as exc:
            retry_after = [(b"retry-after", str(exc.retry_after_s).encode())]
            await out.error(exc.status, exc.message, "overloaded", extra=retry_after)
        except Exception:
            log.exception("request %s: internal error", request_id)
            await out.error(500, "pdserve internal error; see the proxy log", "InternalServerError")


def _pool(role: Role, urls: Sequence[str], config: ProxyConfig) -> Pool:
    t = config.timeouts
    instances = [
        Instance(
            Upstream(role, url, t.connect, config.max_connections_per_upstream),
            CircuitBreaker(config.breaker_threshold, config.breaker_cooldown_s),
        )
        for url in urls
    ]
    return Pool(role, instances, unhealthy_after_checks=config.unhealthy_after_checks)


def create_app(config: ProxyConfig) -> Starlette:
    t = config.timeouts
    prefill, decode = (
        _pool("prefill", config.prefill_urls, config),
        _pool("decode", config.decode_urls, config),
    )
    pools = (prefill, decode)
    options = PolicyOptions(config.prefix_block_size, config.prefix_load_cost_tokens)
    tokenizer = PromptTokenizer.from_model_dir(config.tokenizer) if config.tokenizer else None
    if config.tokenizer and tokenizer is None:
        log.warning("no tokenizer.json in %s: prompt-aware routing falls back to load only", config.tokenizer)
    flow = Flow(
        prefill,
        decode,
        make_policy(config.prefill_policy, options),
        make_policy(config.decode_policy, options),
        config,
        tokenizer,
    )
    prefill.on_recovered = decode.on_recovered = flow.forget_cache

    async def check_now() -> list[dict[str, object]]:
        await asyncio.gather(*(p.check_all(config.health_timeout_s) for p in pools))
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
                reply = await instance.upstream.get(
                    "/v1/models", "models", t.connect + config.health_timeout_s
                )
            except UpstreamError as exc:
                errors.append(str(exc))
                continue
            return Response(reply.body, status_code=reply.status, media_type=reply.content_type)
        message = "no decode instance answered /v1/models: " + "; ".join(errors)
        return error_response(502, message, "upstream_unavailable")

    async def requests(request: Request) -> Response:
        if not is_authorized(request, config.admin_api_key):
            return error_response(401, "missing or wrong admin API key", "AuthenticationError")
        return JSONResponse({"requests": [trace.as_dict() for trace in flow.traces]})

    async def metrics(_: Request) -> Response:
        return Response(render_metrics(flow, pools, admission), media_type="text/plain; version=0.0.4")

    async def model_ids(instance: Instance) -> set[str]:
        try:
            reply = await instance.upstream.get("/v1/models", "models", t.connect + config.health_timeout_s)
            return {m["id"] for m in orjson.loads(reply.body)["data"]} if reply.status == 200 else set()
        except (UpstreamError, orjson.JSONDecodeError, KeyError, TypeError):
            return set()

    async def check_models_match() -> None:
        """Prefill and decode must serve the same model; a mismatch is refused at start."""
        served = {i.url: await model_ids(i) for p in pools for i in p.instances}
        by_role = {p.role: set().union(*(served[i.url] for i in p.instances)) for p in pools}
        if by_role["prefill"] and by_role["decode"] and not by_role["prefill"] & by_role["decode"]:
            detail = "; ".join(f"{url} serves {sorted(ids)}" for url, ids in served.items() if ids)
            raise ConfigError(f"prefill and decode instances serve different models: {detail}")

    async def health_loop() -> None:
        while True:
            await asyncio.sleep(config.health_interval_s)
            await asyncio.gather(*(p.check_all(config.health_timeout_s) for p in pools))

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        for instance in (i for p in pools for i in p.instances):
            await instance.upstream.open()
        checker = asyncio.create_task(health_loop())
        try:
            await check_models_match()
            yield
        finally:
            checker.cancel()
            await asyncio.gather(checker, return_exceptions=True)
            await asyncio.gather(*(i.upstream.close() for p in pools for i in p.instances))

    admission = Admission(config.max_concurrent, config.max_queued, config.queue_timeout_s)
    routes = [
        Route(
            "/v1/completions", GenerationEndpoint(flow, "completions", config, admission), methods=["POST"]
        ),
        Route("/v1/chat/completions", GenerationEndpoint(flow, "chat", config, admission), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/instances", instances, methods=["GET"]),
        Route("/requests", requests, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin_routes(config, flow, {"prefill": prefill, "decode": decode}, model_ids),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.flow = flow
    return app
