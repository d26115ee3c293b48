"""The proxy's routes: the two generation endpoints (raw ASGI) and the read-only ones.

    POST /v1/completions, /v1/chat/completions   the PD flow (flow.py), behind the API key and admission;
                                                 with X-Pdserve-Whole-On, one named instance's whole
                                                 answer (wholeon.py, behind the admin key)
    GET  /v1/models                              a decode instance's answer, behind the API key
    GET  /health                                 200 when >= 1 prefill and >= 1 decode instance can serve
    GET  /instances                              each instance's role, URL, state, circuit, in-flight, load
    GET  /requests[?id=X]                        the last requests' walk-through (admin key if set)
    GET  /metrics                                the proxy's Prometheus metrics (metrics.py)

Of a proxy of several workers, /instances, /requests and /metrics span them all; an answer that lacks a
worker's part says which in ``X-Pdserve-Partial`` (peers.py).

Reads never act: /health and /instances report what the health checker last saw. What a client reads
of an error names an instance by its pool name (``InstanceNames``), not its URL, unless the proxy is
told to show URLs; a client's X-Request-Id is used only when ``usable_request_id`` takes it.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import re
import secrets
import time
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve import protocol
from pdserve.asgi import Receive, Scope, Send, read_body, run_until_disconnect, three_headers
from pdserve.errors import BodyTooLarge, ClientGone, Overloaded, UpstreamError, WholeOnRefused
from pdserve.protocol import Endpoint
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.record.responder import Redact, Responder
from pdserve.proxy.request.wholeon import WHOLE_ON, asked_whole_on
from pdserve.proxy.serving.context import Context, context
from pdserve.proxy.serving.exposition import render as render_metrics
from pdserve.proxy.serving.peers import partial_headers

log = logging.getLogger("pdserve.proxy")

MAX_REQUEST_ID: Final = 128
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID}}}")
REQUEST_ID_RULE: Final = f"1 to {MAX_REQUEST_ID} of A-Z a-z 0-9 . _ : -"


def usable_request_id(given: str | None) -> tuple[str | None, str | None]:
    """The client's X-Request-Id when it is one the proxy passes on (to vLLM, logs, /requests), else None
    and why not: a request id is bounded in length and charset, so that no client puts 60 KB or
    control characters into every instance's request and log."""
    if given is None or _REQUEST_ID.fullmatch(given):
        return given, None
    return None, f"the X-Request-Id sent was not {REQUEST_ID_RULE}; this one replaces it"


class InstanceNames:
    """What clients read of an instance: its pool name ("decode-0": the first decode /instances lists, as `pdserve up` and its logs name it),
    found when an error is written (never on a token's path)."""

    def __init__(self, state: ProxyState) -> None:
        self._state = state

    def __call__(self, text: str) -> str:
        names = {instance.url: name for name, instance in self._state.by_name().items()}
        for url in sorted(names, key=len, reverse=True):  # http://h:80 must not eat http://h:8000
            if url in text:
                text = text.replace(url, names[url])
        return text


def client_redact(ctx: Context) -> Redact | None:
    return None if ctx.config.api_keys.show_instance_urls else InstanceNames(ctx.state)


def error_response(status: int, message: str, err_type: str) -> Response:
    """An OpenAI-style error as a Starlette response (for the non-streaming routes)."""
    return Response(protocol.error_body(message, err_type, status), status, media_type="application/json")


def is_authorized(request: Request, key: str | None) -> bool:
    if key is None:
        return True
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


class RequestIds:
    """Request ids as ``uuid4().hex`` looks (32 hex digits) without a syscall each: a random 64-bit
    prefix per endpoint, then a counter. Unique across restarts and proxies by the prefix."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._counter = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


class GenerationEndpoint:
    """ASGI app for one generation route: reads the body, runs the flow, cancels it on disconnect."""

    def __init__(self, ctx: Context, endpoint: Endpoint) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._new_request_id = RequestIds()
        self._redact = client_redact(ctx)
        config = ctx.config
        self._expected_auth = f"Bearer {config.api_keys.client}".encode() if config.api_keys.client else None
        self._upstream_auth = f"Bearer {config.api_keys.upstream}" if config.api_keys.upstream else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived, arrived_ns = time.perf_counter(), time.time_ns()
        given_id, auth, named = three_headers(scope, b"x-request-id", b"authorization", WHOLE_ON)
        request_id, replaced = usable_request_id(given_id)
        out = Responder(send, request_id or self._new_request_id(), self._redact, replaced)
        if self._expected_auth is not None:
            if not hmac.compare_digest((auth or "").encode("latin-1"), self._expected_auth):
                await out.error(
                    401, "Invalid or missing API key (Authorization: Bearer ...)", "AuthenticationError"
                )
                return
            auth = None  # the proxy's key is not the instances' key
        auth = self._upstream_auth or auth
        whole_on = None
        if named is not None:  # the admin's reference request (wholeon.py)
            try:
                whole_on = asked_whole_on(named, scope, self._ctx.state, self._ctx.config.api_keys.admin)
            except WholeOnRefused as exc:
                kind = "AuthenticationError" if exc.status == 401 else "NotFoundError"
                await out.error(exc.status, exc.message, kind)
                return
        max_body = self._ctx.config.admission.max_body_bytes
        try:
            raw = await read_body(receive, max_body)
        except BodyTooLarge:
            await out.error(413, f"Request body exceeds {max_body} bytes", "BadRequestError")
            return
        except ClientGone:
            return
        admission = self._ctx.admission
        try:
            if not admission.try_acquire():
                await admission.acquire()
            try:
                work = self._ctx.flow.serve(self._endpoint, raw, auth, out, arrived, arrived_ns, whole_on)
                if await run_until_disconnect(work, receive, out, loop=self._ctx.state.loop):
                    log.info("request %s: client disconnected; upstream calls cancelled", request_id)
            finally:
                admission.release()
        except Overloaded as exc:
            retry_after = [(b"retry-after", str(exc.retry_after_s).encode())]
            await out.error(exc.status, exc.message, "overloaded", extra=retry_after)
        except Exception:
            log.exception("request %s: internal error", request_id)
            await out.error(500, "pdserve internal error; see the proxy log", "InternalServerError")


async def models(request: Request) -> Response:
    ctx = context(request)
    key = ctx.config.api_keys.client
    if key is not None and not is_authorized(request, key):
        return error_response(
            401, "Invalid or missing API key (Authorization: Bearer ...)", "AuthenticationError"
        )
    decode = ctx.state.pool("decode")
    timeout = ctx.config.models_timeout_s
    errors = []
    for instance in decode.available() or decode.instances:
        try:
            reply = await instance.upstream.get("/v1/models", "models", timeout)
        except UpstreamError as exc:
            errors.append(str(exc))
            continue
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type)
    message = "no decode instance answered /v1/models: " + "; ".join(errors)
    redact = client_redact(ctx)
    return error_response(502, redact(message) if redact else message, "upstream_unavailable")


async def health(request: Request) -> JSONResponse:
    """This worker's own answer: a load balancer's probe must not wait on the others."""
    state = context(request).state
    ok = state.can_serve()
    body = {"status": "ok" if ok else "unavailable", "instances": state.describe()}
    return JSONResponse(body, status_code=200 if ok else 503)


async def describe_instances(request: Request) -> list[dict[str, object]]:
    """Each instance as this worker sees it, with what every worker has in flight there."""
    ctx = context(request)
    return await ctx.fanout.instances(request, ctx.state.describe())


async def instances(request: Request) -> JSONResponse:
    return JSONResponse(await describe_instances(request), headers=partial_headers(request))


async def requests(request: Request) -> Response:
    ctx = context(request)
    if not is_authorized(request, ctx.config.api_keys.admin):
        return error_response(401, "missing or wrong admin API key", "AuthenticationError")
    wanted = request.query_params.get("id")
    found = [t.as_dict() for t in ctx.state.traces if wanted is None or t.request_id == wanted]
    return JSONResponse(
        {"requests": await ctx.fanout.requests(request, found)}, headers=partial_headers(request)
    )


async def metrics(request: Request) -> Response:
    ctx = context(request)
    text = await ctx.fanout.metrics(request, render_metrics(ctx.state, ctx.admission))
    return Response(text, media_type="text/plain; version=0.0.4", headers=partial_headers(request))
