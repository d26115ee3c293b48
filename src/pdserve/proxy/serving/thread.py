"""The proxy in this process, on a thread of its own: what `pdserve up` and the tests run in front of
the instances they start. ``proxy_for`` picks it, or the worker processes of workers.py when the config
asks for several.

The thread runs uvicorn on uvloop; signals stay with the main thread, which stops the proxy with
``stop``. What the launcher learns of instances reaches the proxy through ``deliver``, from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import uvloop

from pdserve.config import ProxyConfig
from pdserve.errors import EngineError
from pdserve.events import InstanceEvent, KVLogEvent
from pdserve.proxy.serving import app as proxy_app
from pdserve.proxy.serving.server import make_server
from pdserve.proxy.serving.workers import ProxyWorkers

_START_TIMEOUT_S = 15.0


class ProxyThread:
    """The proxy served by uvicorn on uvloop in a background thread."""

    def __init__(self, config: ProxyConfig, log_level: str = "warning") -> None:
        self.config = config
        self._app = proxy_app.create_app(config)
        self._server = make_server(config, log_level, self._app)
        self._thread = threading.Thread(target=self._run, name="pdserve-proxy", daemon=True)
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _run(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            await self._server.serve()

        try:
            uvloop.run(serve())
        except BaseException as exc:
            self._error = exc

    def deliver(self, event: InstanceEvent | KVLogEvent) -> None:
        """Hand the proxy what the launcher learnt; safe from any thread, a no-op once it stopped."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
            loop.call_soon_threadsafe(proxy_app.deliver, self._app, event)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EngineError(f"proxy did not start on {self.url}: {self._error or 'timed out'}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def proxy_for(config: ProxyConfig, log_level: str = "warning") -> ProxyThread | ProxyWorkers:
    """The proxy of ``config``, not yet started: on a thread here, or as its worker processes."""
    return ProxyWorkers(config, log_level) if config.workers > 1 else ProxyThread(config, log_level)
