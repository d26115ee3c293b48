"""The admin API: change the pools at run time and look inside the KV ledger.

    GET    /admin/instances           every instance with health, circuit, load
    POST   /admin/instances           {"role": "prefill"|"decode", "url": ...}: add (model must match)
    POST   /admin/instances/drain     {"url": ...}: take no new requests, finish in-flight ones
    DELETE /admin/instances           {"url": ...}: drain, then remove once nothing is in flight
    GET    /admin/ledger              open and recent KV handoffs, counts by outcome

All need "Authorization: Bearer <admin_api_key>"; without a configured key the admin API is off (403).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve import protocol
from pdserve.config import ROLES, ProxyConfig, normalize_url
from pdserve.errors import ConfigError
from pdserve.proxy.flow import Flow
from pdserve.proxy.pool import CircuitBreaker, Instance, Pool
from pdserve.proxy.upstream import Upstream

log = logging.getLogger("pdserve.proxy")

_DRAIN_POLL_S = 0.1
_DRAIN_LIMIT_S = 600.0

Handler = Callable[[Request], Awaitable[Response]]


def error_response(status: int, message: str, err_type: str) -> Response:
    """An OpenAI-style error as a Starlette response (for the non-streaming routes)."""
    return Response(protocol.error_body(message, err_type, status), status, media_type="application/json")


def is_authorized(request: Request, key: str | None) -> bool:
    if key is None:
        return True
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


def guarded(key: str | None, handler: Handler) -> Handler:
    async def wrapper(request: Request) -> Response:
        if key is None:
            return error_response(
                403, "the admin API is off; start the proxy with --admin-api-key", "PermissionDenied"
            )
        if not is_authorized(request, key):
            return error_response(401, "missing or wrong admin API key", "AuthenticationError")
        return await handler(request)

    return wrapper


def admin_routes(
    config: ProxyConfig,
    flow: Flow,
    pools: dict[str, Pool],
    model_ids: Callable[[Instance], Awaitable[set[str]]],
) -> list[Route]:
    tasks: set[asyncio.Task[None]] = set()

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            data = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"invalid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError("body must be a JSON object")
        return data

    def find(url: str) -> Instance:
        for pool in pools.values():
            found = pool.find(normalize_url(url))
            if found:
                return found
        raise LookupError(url)

    async def list_instances(_: Request) -> Response:
        return JSONResponse([i.describe() for p in pools.values() for i in p.instances])

    async def add(request: Request) -> Response:
        try:
            data = await body_of(request)
            role, url = data.get("role"), normalize_url(str(data.get("url", "")))
            if role not in ROLES:
                raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        except ConfigError as exc:
            return error_response(400, str(exc), "BadRequestError")
        pool = pools[role]
        if any(p.find(url) for p in pools.values()):
            return error_response(409, f"{url} is already in a pool", "Conflict")
        t = config.timeouts
        instance = Instance(
            Upstream(role, url, t.connect, config.max_connections_per_upstream),
            CircuitBreaker(config.breaker_threshold, config.breaker_cooldown_s),
        )
        await instance.upstream.open()
        served = await model_ids(instance)
        expected = set().union(*[await model_ids(i) for p in pools.values() for i in p.instances[:1]])
        if not served or (expected and not served & expected):
            await instance.upstream.close()
            why = (
                "does not answer /v1/models"
                if not served
                else f"serves {sorted(served)}, not {sorted(expected)}"
            )
            return error_response(400, f"refusing {url}: it {why}", "BadRequestError")
        pool.instances.append(instance)
        log.info("admin: added %s instance %s", role, url)
        return JSONResponse(instance.describe(), status_code=201)

    async def drain(request: Request) -> Response:
        try:
            instance = find(str((await body_of(request)).get("url", "")))
        except (ConfigError, LookupError) as exc:
            return error_response(404, f"no such instance: {exc}", "NotFoundError")
        instance.is_draining = True
        log.info(
            "admin: draining %s instance %s (%d in flight)",
            instance.role,
            instance.url,
            instance.num_in_flight,
        )
        return JSONResponse(instance.describe())

    async def remove(request: Request) -> Response:
        try:
            instance = find(str((await body_of(request)).get("url", "")))
        except (ConfigError, LookupError) as exc:
            return error_response(404, f"no such instance: {exc}", "NotFoundError")
        instance.is_draining = True
        flow.forget_cache(instance)
        task = asyncio.create_task(_remove_when_idle(pools[instance.role], instance))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return JSONResponse(instance.describe(), status_code=202)

    async def ledger(_: Request) -> Response:
        return JSONResponse(flow.ledger.snapshot())

    key = config.admin_api_key
    return [
        Route("/admin/instances", guarded(key, list_instances), methods=["GET"]),
        Route("/admin/instances", guarded(key, add), methods=["POST"]),
        Route("/admin/instances", guarded(key, remove), methods=["DELETE"]),
        Route("/admin/instances/drain", guarded(key, drain), methods=["POST"]),
        Route("/admin/ledger", guarded(key, ledger), methods=["GET"]),
    ]


async def _remove_when_idle(pool: Pool, instance: Instance) -> None:
    """Drained: wait for its in-flight requests (bounded), then drop it and close its connections."""
    waited = 0.0
    while instance.num_in_flight and waited < _DRAIN_LIMIT_S:
        await asyncio.sleep(_DRAIN_POLL_S)
        waited += _DRAIN_POLL_S
    if instance in pool.instances:
        pool.instances.remove(instance)
    await instance.upstream.close()
    log.info("admin: removed %s instance %s", instance.role, instance.url)
