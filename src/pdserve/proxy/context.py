"""What the route handlers reach through ``request.app.state.pdserve``: the app's parts, composed once
by ``create_app``."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from pdserve.config import ProxyConfig
from pdserve.proxy.admission import Admission
from pdserve.proxy.flow import Flow
from pdserve.proxy.health import HealthChecker
from pdserve.proxy.peers import Peers, is_peer
from pdserve.proxy.state import ProxyState


@dataclass(frozen=True)
class Context:
    config: ProxyConfig
    state: ProxyState
    flow: Flow
    admission: Admission
    health: HealthChecker
    peers: Peers | None = None  # the other workers of a multi-process proxy (peers.py)


def peers_of(request: Request) -> Peers | None:
    """The other workers whose state this request's answer must include: none when the proxy is one
    process, or when a peer asks (it wants this worker's own state)."""
    peers = context(request).peers
    return None if peers is None or is_peer(request.scope) else peers


def context(request: Request) -> Context:
    ctx: Context = request.app.state.pdserve
    return ctx
