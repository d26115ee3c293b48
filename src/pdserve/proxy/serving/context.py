"""What the route handlers reach through ``request.app.state.pdserve``: the app's parts, composed once
by ``create_app``."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from pdserve.config import ProxyConfig
from pdserve.proxy.pool.health import HealthChecker
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.request.flow import Flow
from pdserve.proxy.serving.admission import Admission
from pdserve.proxy.serving.peers import Fanout


@dataclass(frozen=True)
class Context:
    config: ProxyConfig
    state: ProxyState
    flow: Flow
    admission: Admission
    health: HealthChecker
    fanout: Fanout  # the other workers of a multi-process proxy, or none (peers.py)


def context(request: Request) -> Context:
    ctx: Context = request.app.state.pdserve
    return ctx
