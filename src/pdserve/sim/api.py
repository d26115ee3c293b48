"""A sim instance's HTTP API: vLLM's OpenAI-compatible routes plus the simulator's own ``/sim/*``.

Routes:
    POST /v1/completions, /v1/chat/completions   generation (sim/generation.py)
    GET  /v1/models                              the served model, in vLLM's shape
    GET  /health                                 200 with an empty body, as vLLM
    GET  /metrics                                Prometheus text in vLLM's names (sim/vllm_metrics.py)
    POST /reset_prefix_cache                     forget the prefix cache (vLLM serves it in dev mode)
    GET  /sim/faults, POST /sim/faults           the injected faults; POST merges the given fields
    POST /sim/kv/pull                            another process's decoder reads KV this instance holds
    POST /sim/kv/heartbeat                       another process's decoder keeps leases here alive
    POST /sim/stall      {"seconds": S}          the engine stops stepping for S s (SIGSTOP of EngineCore)
    POST /sim/restart    {"down_s": S}           die now, serve again after S s under a new engine id
    GET  /sim/stats                              role, engine id, URL and the engine's counters

A plain ASGI dispatcher rather than a framework: the generation routes are raw ASGI anyway, and
unknown paths and methods get FastAPI's ``{"detail": ...}`` bodies, as from vLLM. While the instance is
"down" (or restarting) every route but ``/sim/*`` closes the connection unanswered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from pdserve.asgi import ASGIApp, Receive, Scope, Send, read_body
from pdserve.errors import ClientGone, ConfigError, KVPullError
from pdserve.protocol import error_body
from pdserve.sim.generation import GenerationEndpoint
from pdserve.sim.replica import SimInstance
from pdserve.sim.transfer import HEARTBEAT_PATH, PULL_PATH, held_to_mapping
from pdserve.sim.wire import JSON, Writer, drop_unanswered

log = logging.getLogger("pdserve.sim")

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
_SMALL_BODY = 1024 * 1024
_METRICS_TYPE = b"text/plain; version=1.0.0; charset=utf-8"


async def _bad_request(send: Send, message: str) -> None:
    await Writer(send).whole(400, error_body(message, "BadRequestError", 400))


async def _seconds(receive: Receive, send: Send, field: str) -> float | None:
    """``field`` of a small JSON body, a number of seconds >= 0; None when there is none to act on: the
    client hung up, or was answered 400 here."""
    try:
        body = orjson.loads(await read_body(receive, _SMALL_BODY) or b"{}")
    except ClientGone:
        return None
    except orjson.JSONDecodeError as exc:
        await _bad_request(send, f"body is not JSON: {exc}")
        return None
    value = body.get(field) if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        await _bad_request(send, f'body must be {{"{field}": seconds >= 0}}, got {body!r}')
        return None
    return float(value)


async def _json(send: Send, status: int, data: Any) -> None:
    await Writer(send).whole(status, orjson.dumps(data))


def _models(inst: SimInstance) -> dict[str, Any]:
    created = int(time.time())
    permission = {
        "id": f"modelperm-{inst.engine_id.replace('-', '')[:16]}", "object": "model_permission",
        "created": created, "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False,
    }  # fmt: skip
    model = {
        "id": inst.model_name, "object": "model", "created": created, "owned_by": "vllm",
        "root": f"pdserve-sim/{inst.profile.name}", "parent": None,
        "max_model_len": inst.profile.max_model_len, "permission": [permission],
    }  # fmt: skip
    return {"object": "list", "data": [model]}


def create_sim_app(instance: SimInstance) -> ASGIApp:
    inst = instance
    restarts: set[asyncio.Task[None]] = set()  # this app's restarts under way, kept so none is collected

    async def models(scope: Scope, receive: Receive, send: Send) -> None:
        await _json(send, 200, _models(inst))

    async def health(scope: Scope, receive: Receive, send: Send) -> None:
        await Writer(send).whole(200, b"", content_type=None)

    async def metrics(scope: Scope, receive: Receive, send: Send) -> None:
        await Writer(send).whole(200, inst.metrics.render(inst.engine.stats).encode(), _METRICS_TYPE)

    async def reset_prefix_cache(scope: Scope, receive: Receive, send: Send) -> None:
        num = inst.engine.reset_prefix_cache()
        log.info("sim %s (%s): prefix cache reset (%d blocks forgotten)", inst.engine_id, inst.role, num)
        await _json(send, 200, {"success": True})

    async def get_faults(scope: Scope, receive: Receive, send: Send) -> None:
        await _json(send, 200, inst.faults.spec.to_mapping())

    async def set_faults(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            changes = orjson.loads(await read_body(receive, _SMALL_BODY) or b"{}")
            if not isinstance(changes, dict):
                raise ConfigError("POST /sim/faults takes a JSON object of fault fields")
            spec = inst.faults.update(changes)
        except ClientGone:
            return
        except (orjson.JSONDecodeError, ConfigError, TypeError) as exc:
            await Writer(send).whole(400, error_body(str(exc), "BadRequestError", 400))
            return
        log.info("sim %s (%s): faults now %s", inst.engine_id, inst.role, spec)
        await _json(send, 200, spec.to_mapping())

    async def pull(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = orjson.loads(await read_body(receive, _SMALL_BODY))
            engine_id, request_id = body["remote_engine_id"], body["remote_request_id"]
        except ClientGone:
            return
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = "body must be a JSON object with remote_engine_id and remote_request_id"
            await Writer(send).whole(400, error_body(message, "BadRequestError", 400))
            return
        if engine_id != inst.engine_id:
            message = f"engine {engine_id!r} is not served here (this is {inst.engine_id!r})"
            await Writer(send).whole(404, error_body(message, "NotFoundError", 404))
            return
        try:
            held = inst.serve_pull(str(request_id))
        except KVPullError as exc:
            await Writer(send).whole(404, error_body(str(exc), "NotFoundError", 404))
            return
        await _json(send, 200, held_to_mapping(held))

    async def heartbeat(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = orjson.loads(await read_body(receive, _SMALL_BODY))
            engine_id, request_ids = body["remote_engine_id"], body["remote_request_ids"]
            ids = tuple(str(r) for r in request_ids)
        except ClientGone:
            return
        except (orjson.JSONDecodeError, KeyError, TypeError):
            await _bad_request(
                send, "body must be a JSON object with remote_engine_id and remote_request_ids"
            )
            return
        if engine_id == inst.engine_id:  # a heartbeat for an old engine id finds nothing, as in vLLM
            inst.heartbeat(ids)
        await _json(send, 200, {})

    async def stall(scope: Scope, receive: Receive, send: Send) -> None:
        seconds = await _seconds(receive, send, "seconds")
        if seconds is None:
            return
        inst.engine.stall(seconds)
        log.info("sim %s (%s): engine stalled for %g s", inst.engine_id, inst.role, seconds)
        await _json(send, 200, {"engine_id": inst.engine_id, "stalled_s": seconds})

    async def restart(scope: Scope, receive: Receive, send: Send) -> None:
        down_s = await _seconds(receive, send, "down_s")
        if down_s is None:
            return
        if inst.is_restarting:
            await Writer(send).whole(409, error_body("already restarting", "ConflictError", 409))
            return
        old, new = inst.engine_id, str(uuid.uuid4())
        task = asyncio.get_running_loop().create_task(inst.restart(down_s, new), name=f"sim-restart-{old}")
        restarts.add(task)
        task.add_done_callback(restarts.discard)
        await asyncio.sleep(0)  # the restart has begun (connections cut) before the caller hears back
        log.info("sim %s (%s): restarting as %s in %g s", old, inst.role, new, down_s)
        await _json(send, 200, {"engine_id": old, "new_engine_id": new, "down_s": down_s})

    async def stats(scope: Scope, receive: Receive, send: Send) -> None:
        data = {"role": inst.role, "engine_id": inst.engine_id, "url": inst.url,
                "stats": dataclasses.asdict(inst.engine.stats)}  # fmt: skip
        await _json(send, 200, data)

    routes: dict[str, dict[str, Handler]] = {
        "/v1/completions": {"POST": GenerationEndpoint(inst, "completions")},
        "/v1/chat/completions": {"POST": GenerationEndpoint(inst, "chat")},
        "/v1/models": {"GET": models},
        "/health": {"GET": health},
        "/metrics": {"GET": metrics},
        "/reset_prefix_cache": {"POST": reset_prefix_cache},
        "/sim/faults": {"GET": get_faults, "POST": set_faults},
        PULL_PATH: {"POST": pull},
        HEARTBEAT_PATH: {"POST": heartbeat},
        "/sim/stall": {"POST": stall},
        "/sim/restart": {"POST": restart},
        "/sim/stats": {"GET": stats},
    }

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(inst, receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if not inst.is_reachable and not path.startswith("/sim/"):
            await drop_unanswered(send, receive)
            return
        methods = routes.get(path)
        if methods is None:
            await Writer(send).whole(404, b'{"detail":"Not Found"}', JSON)
            return
        handler = methods.get(scope["method"])
        if handler is None:
            await Writer(send).whole(405, b'{"detail":"Method Not Allowed"}', JSON)
            return
        await handler(scope, receive, send)

    return app


async def _lifespan(inst: SimInstance, receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await inst.start()
            except Exception as exc:
                log.exception("sim %s: engine failed to start", inst.engine_id)
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await inst.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return
