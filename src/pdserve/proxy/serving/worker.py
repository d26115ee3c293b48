"""One worker of a multi-process proxy: the process workers.py starts ``config.workers`` of.

It serves the whole proxy (``create_app`` with its ``Peers``) on two sockets: the shared TCP port, bound
with SO_REUSEPORT so that the kernel spreads client connections over the workers, and a Unix socket of
its own in the workers' private directory, where its peers and the launcher reach it (peers.py). It
stops when its parent is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import uvicorn
import uvloop

from pdserve.config import ProxyConfig
from pdserve.proxy.serving.app import create_app
from pdserve.proxy.serving.peers import Peers, socket_path
from pdserve.proxy.serving.server import make_server, tune_gc

_BACKLOG = 2048
_PARENT_POLL_S = 1.0


def run_worker(config: ProxyConfig, index: int, directory: str, log_level: str) -> None:
    """The worker's whole life (a multiprocessing target): serve until SIGTERM/SIGINT or orphaned."""
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[worker {index}]: %(message)s"
    )
    app = create_app(config, peers=Peers(directory, index, config.workers))
    server = make_server(config, log_level, app)
    sockets = [_shared_port(config.host, config.port), _own_socket(socket_path(directory, index))]
    tune_gc()
    uvloop.run(_serve(server, sockets, os.getppid()))


async def _serve(server: uvicorn.Server, sockets: list[socket.socket], parent: int) -> None:
    watch = asyncio.create_task(_stop_when_orphaned(server, parent))
    try:
        await server.serve(sockets=sockets)
    finally:
        watch.cancel()


async def _stop_when_orphaned(server: uvicorn.Server, parent: int) -> None:
    # A parent killed outright (SIGKILL) cannot stop its workers: they notice their new parent.
    while os.getppid() == parent:
        await asyncio.sleep(_PARENT_POLL_S)
    server.should_exit = True


def _shared_port(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(_BACKLOG)
    return sock


def _own_socket(path: str) -> socket.socket:
    if os.path.exists(path):
        os.unlink(path)  # a previous incarnation's
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(_BACKLOG)
    return sock
