"""``create_app(config)``: composes the proxy's parts and its routes (routes.py, admin.py).

The parts: ``ProxyState`` (state.py) owns pools, instances, ledger and counters; ``Flow`` (flow.py)
serves a request; ``Admission`` bounds concurrency; ``HealthChecker`` (health.py) watches instances;
``Fanout`` (peers.py) makes the reads and admin changes of one worker span every worker of the proxy.
The lifespan opens every instance's connection pool, checks that both roles serve one model, runs the
health checks, and closes everything on the way out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from starlette.applications import Starlette
from starlette.routing import Route

from pdserve.asgi import ASGIApp, Receive, Scope, Send
from pdserve.config import ROLES, ProxyConfig, lease_warnings
from pdserve.errors import UpstreamError
from pdserve.events import InstanceEvent, KVLogEvent
from pdserve.proxy.pool import startup
from pdserve.proxy.pool.health import HealthChecker
from pdserve.proxy.pool.models import check_models_match
from pdserve.proxy.pool.policies import PolicyOptions, make_policy
from pdserve.proxy.pool.state import ProxyState, UpstreamFactory
from pdserve.proxy.record.otel import RequestTracing
from pdserve.proxy.request.flow import Flow
from pdserve.proxy.request.tokens import PromptTokenizer
from pdserve.proxy.serving import routes
from pdserve.proxy.serving.admin import ADMIN_ROUTES
from pdserve.proxy.serving.admission import Admission
from pdserve.proxy.serving.context import Context
from pdserve.proxy.serving.peer_routes import PEER_ROUTES
from pdserve.proxy.serving.peers import Fanout, Peers

log = logging.getLogger("pdserve.proxy")


def create_app(
    config: ProxyConfig, make_upstream: UpstreamFactory | None = None, peers: Peers | None = None
) -> Starlette:
    """The proxy; ``peers``: it is one worker of several (worker.py), which share its port."""
    fanout = peers if peers is not None else Fanout()
    options = PolicyOptions(config.routing.prefix_block_size, config.routing.prefix_load_cost_tokens)
    # A policy per part of a request, the policy of the pool that takes it (an elastic pool takes both).
    policies = {part: fanout.sharing(part, make_policy(config.pool(part).policy, options)) for part in ROLES}
    state = ProxyState(config, policies, make_upstream, share_stranded=peers.tell_stranded if peers else None)
    tokenizer = PromptTokenizer.from_model_dir(config.routing.tokenizer) if config.routing.tokenizer else None
    if config.routing.tokenizer and tokenizer is None:
        log.warning(
            "no tokenizer.json in %s: prompt-aware routing falls back to load only", config.routing.tokenizer
        )
    tracing = RequestTracing(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
    share = config.worker_share() if peers is not None else config
    ctx = Context(
        config=config,
        state=state,
        flow=Flow(state, config, tokenizer, tracing),
        admission=Admission(
            share.admission.max_concurrent, share.admission.max_queued, config.admission.queue_timeout_s
        ),
        health=HealthChecker(state, config.health.interval_s, config.health.timeout_s),
        fanout=fanout,
    )

    # --- Kubernetes discovery (proxy/pool/discovery.py), only when configured: lightkube is an optional
    # extra, imported here so a proxy without discovery never needs it; a missing extra or cluster
    # config fails now, at start, not in the lifespan.
    discovery = None
    if config.is_discovering:
        from pdserve.proxy.pool.discovery import Discovery

        discovery = Discovery(state, config)
    # --- end of Kubernetes discovery

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        for warning in lease_warnings(config):
            log.warning("%s", warning)
        await state.open()
        checker = asyncio.create_task(ctx.health.run())
        discoverer = asyncio.create_task(discovery.run()) if discovery is not None else None  # k8s
        sharing = asyncio.create_task(fanout.run())
        learning = asyncio.create_task(_learn_max_model_len(ctx))
        # An elastic pool's router calibrates from a few lone requests before the first client's (startup.py).
        measuring = _measure_pool(ctx)
        try:
            prefill, decode = state.pool("prefill").instances, state.pool("decode").instances
            await check_models_match(prefill, decode, config.models_timeout_s)
            yield
        finally:
            checker.cancel()
            sharing.cancel()
            learning.cancel()
            if measuring is not None:
                measuring.cancel()
            if discoverer is not None:  # k8s discovery: stop before the instances close
                discoverer.cancel()
                await asyncio.gather(discoverer, return_exceptions=True)
            await asyncio.gather(checker, return_exceptions=True)
            await state.close()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # flushes the last spans

    generation: dict[str, ASGIApp] = {
        "/v1/completions": routes.GenerationEndpoint(ctx, "completions"),
        "/v1/chat/completions": routes.GenerationEndpoint(ctx, "chat"),
    }
    app = Starlette(
        routes=[
            *(Route(path, endpoint, methods=["POST"]) for path, endpoint in generation.items()),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/instances", routes.instances, methods=["GET"]),
            Route("/requests", routes.requests, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            *ADMIN_ROUTES,
            *PEER_ROUTES,
        ],
        lifespan=lifespan,
    )
    app.state.pdserve = ctx
    app.state.generation = generation
    return app


class ProxyApp:
    """What the server runs: a POST to a generation route goes straight to its endpoint, everything
    else (other routes, other methods, the lifespan) through Starlette.

    The generation endpoints are raw ASGI apps that answer every error themselves, so Starlette's
    routing and middleware (about a tenth of the proxy's CPU per request, profiled) buy them nothing.
    """

    def __init__(self, app: Starlette) -> None:
        self._app = app
        self._generation: dict[str, ASGIApp] = app.state.generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._generation.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self._app(scope, receive, send)


def _measure_pool(ctx: Context) -> asyncio.Task[None] | None:
    router, pool = ctx.state.elastic, ctx.config.elastic_pool
    if router is None or not pool.measure_at_start or pool.costs is None:
        return None
    key = ctx.config.api_keys.upstream
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout_s = ctx.config.health.warmup_timeout_s or 30.0
    members = ctx.state.pool("elastic").available
    return asyncio.create_task(startup.run(router, members, headers, timeout_s, ctx.config.health.interval_s,
                                           min(2, len(ctx.state.instances))))  # fmt: skip


async def _learn_max_model_len(ctx: Context) -> None:
    """Hand the flow decode's context length (the smallest a decode tells in /v1/models), asking again
    every health interval until one answers: until then max_tokens beyond it is left to decode."""
    while True:
        lengths = []
        for instance in ctx.state.pool("decode").instances:
            try:
                reply = await instance.upstream.get("/v1/models", "models", ctx.config.models_timeout_s)
                length = (
                    orjson.loads(reply.body)["data"][0].get("max_model_len") if reply.status == 200 else None
                )
            except (UpstreamError, orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
                continue
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                lengths.append(length)
        if lengths:
            ctx.flow.max_model_len = min(lengths)
            return
        await asyncio.sleep(ctx.config.health.interval_s)


def deliver(app: Starlette, event: InstanceEvent | KVLogEvent) -> None:
    """Hand the proxy ``app`` what the launcher learnt; call it on the app's event loop."""
    ctx: Context = app.state.pdserve
    ctx.state.on_event(event)
