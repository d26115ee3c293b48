"""The routes only a proxy worker's own Unix socket serves (peers.py, workers.py); over TCP they are 404.

GET  /_pdserve/ready    200 once the worker serves (workers.py waits for it at start)
POST /_pdserve/event    what the launcher learnt (events.to_dict): the worker's state takes it
POST /_pdserve/prefix   another worker's prompt-aware picks: [{"role", "url", "hashes"}, …]
POST /_pdserve/stranded another worker's push that never came to a decode: {"url"}
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdserve import events
from pdserve.proxy.serving.context import context
from pdserve.proxy.serving.peers import is_peer, read_picks
from pdserve.proxy.serving.routes import error_response

Handler = Callable[[Request], Awaitable[Response]]


def peers_only(handler: Handler) -> Handler:
    async def wrapper(request: Request) -> Response:
        if not is_peer(request.scope):
            return error_response(404, "Not Found", "NotFoundError")
        return await handler(request)

    return wrapper


async def ready(request: Request) -> Response:
    return Response(b"", 200)


async def event(request: Request) -> Response:
    try:
        received = events.from_dict(orjson.loads(await request.body()))
    except (orjson.JSONDecodeError, ValueError, AttributeError) as exc:
        return error_response(400, f"not an event: {exc}", "BadRequestError")
    context(request).state.on_event(received)
    return Response(b"", 204)


async def prefix(request: Request) -> Response:
    state = context(request).state
    try:
        picks = read_picks(await request.body())
    except ValueError as exc:
        return error_response(400, str(exc), "BadRequestError")
    for role, url, hashes in picks:
        state.policy(role).learn(url, hashes)
    return Response(b"", 204)


async def stranded(request: Request) -> Response:
    state = context(request).state
    try:
        url = orjson.loads(await request.body())["url"]
    except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
        return error_response(400, f"not a stranded push: {exc}", "BadRequestError")
    instance = state.find(url) if isinstance(url, str) else None
    if instance is None:
        return error_response(404, f"no instance {url!r}", "NotFoundError")
    state.push_stranded(instance, from_peer=True)
    return Response(b"", 204)


PEER_ROUTES = [
    Route("/_pdserve/ready", peers_only(ready), methods=["GET"]),
    Route("/_pdserve/event", peers_only(event), methods=["POST"]),
    Route("/_pdserve/prefix", peers_only(prefix), methods=["POST"]),
    Route("/_pdserve/stranded", peers_only(stranded), methods=["POST"]),
]
