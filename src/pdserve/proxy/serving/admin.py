"""The admin API: change the pools at run time and look inside the KV ledger.

    GET    /admin/instances           every instance with health, circuit, load
    POST   /admin/instances           {"role": "prefill"|"decode", "url": ...}: add (model must match)
    POST   /admin/instances/drain     {"url": ...}: take no new requests, finish in-flight ones
    DELETE /admin/instances           {"url": ...}: drain, then remove once drained: nothing in flight
                                      and no KV held for a decode that has yet to pull it
    GET    /admin/ledger              open and recent KV handoffs, counts by outcome

All need "Authorization: Bearer <admin_api_key>"; without a configured key the admin API is off (403).
Handlers change nothing themselves: they ask ``ProxyState`` (state.py), which owns the pools. In a proxy of
several workers (workers.py) a change is repeated on every worker and the reads merge theirs (peers.py);
an answer a worker is missing from names it in ``X-Pdserve-Partial``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.config import ROLES, normalize_url
from pdserve.errors import ConfigError
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.models import model_ids, models_in_service
from pdserve.proxy.serving.context import context
from pdserve.proxy.serving.peers import partial_headers
from pdserve.proxy.serving.routes import describe_instances, error_response, is_authorized

Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler) -> Handler:
    async def wrapper(request: Request) -> Response:
        key = context(request).config.api_keys.admin
        if key is None:
            return error_response(
                403, "the admin API is off; start the proxy with --admin-api-key", "PermissionDenied"
            )
        if not is_authorized(request, key):
            return error_response(401, "missing or wrong admin API key", "AuthenticationError")
        return await handler(request)

    return wrapper


def everywhere(handler: Handler) -> Handler:
    """A change this worker made, every other worker of the proxy makes too (peers.py); the client gets
    this worker's answer."""

    async def wrapper(request: Request) -> Response:
        response = await handler(request)
        await context(request).fanout.repeat(request, response)
        return response

    return wrapper


async def _body_of(request: Request) -> dict[str, Any]:
    try:
        data = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("body must be a JSON object")
    return data


async def _instance_named(request: Request) -> Instance:
    """The instance whose URL the body names; LookupError (or ConfigError) when there is none."""
    url = normalize_url(str((await _body_of(request)).get("url", "")))
    found = context(request).state.find(url)
    if found is None:
        raise LookupError(url)
    return found


async def list_instances(request: Request) -> Response:
    return JSONResponse(await describe_instances(request), headers=partial_headers(request))


async def add(request: Request) -> Response:
    ctx = context(request)
    try:
        data = await _body_of(request)
        role, url = data.get("role"), normalize_url(str(data.get("url", "")))
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    except ConfigError as exc:
        return error_response(400, str(exc), "BadRequestError")
    if ctx.state.find(url) is not None:
        return error_response(409, f"{url} is already in a pool", "Conflict")
    timeout = ctx.config.models_timeout_s
    instance = ctx.state.new_instance(role, url)
    await instance.upstream.open()
    served = await model_ids(instance, timeout)
    expected = await models_in_service((ctx.state.pool(r).instances for r in ROLES), timeout)
    if not served or (expected and not served & expected):
        await instance.upstream.close()
        why = (
            "does not answer /v1/models" if not served else f"serves {sorted(served)}, not {sorted(expected)}"
        )
        return error_response(400, f"refusing {url}: it {why}", "BadRequestError")
    ctx.state.add(instance)
    return JSONResponse(ctx.state.describe_instance(instance), status_code=201)


async def drain(request: Request) -> Response:
    return await _on_named(request, context(request).state.drain, 200)


async def remove(request: Request) -> Response:
    return await _on_named(request, context(request).state.remove, 202)


async def _on_named(request: Request, change: Callable[[Instance], None], status: int) -> Response:
    """``change`` the instance the body names; its description after, or 404 when there is none."""
    try:
        instance = await _instance_named(request)
    except (ConfigError, LookupError) as exc:
        return error_response(404, f"no such instance: {exc}", "NotFoundError")
    change(instance)
    return JSONResponse(context(request).state.describe_instance(instance), status_code=status)


async def ledger(request: Request) -> Response:
    ctx = context(request)
    return JSONResponse(
        await ctx.fanout.ledger(request, ctx.state.ledger.snapshot()), headers=partial_headers(request)
    )


ADMIN_ROUTES = [
    Route("/admin/instances", guarded(list_instances), methods=["GET"]),
    Route("/admin/instances", guarded(everywhere(add)), methods=["POST"]),
    Route("/admin/instances", guarded(everywhere(remove)), methods=["DELETE"]),
    Route("/admin/instances/drain", guarded(everywhere(drain)), methods=["POST"]),
    Route("/admin/ledger", guarded(ledger), methods=["GET"]),
]
