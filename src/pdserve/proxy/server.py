"""Serving the proxy app: uvicorn on uvloop with httptools, access log off (the proxy is on every token)."""

from __future__ import annotations

import logging

import uvicorn
from starlette.applications import Starlette

from pdserve.config import ProxyConfig
from pdserve.proxy.app import create_app


def make_server(config: ProxyConfig, log_level: str = "info", app: Starlette | None = None) -> uvicorn.Server:
    uv_config = uvicorn.Config(
        app or create_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=30,
        # The flow bounds every upstream call itself; let uvicorn not cut streams short.
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(uv_config)


def serve(config: ProxyConfig, log_level: str = "info") -> None:
    """Run the proxy until SIGINT/SIGTERM."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = make_server(config, log_level)
    server.run()
