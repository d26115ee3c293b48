"""Serving an ASGI app in a test: over a real socket, in a thread of its own (as a separate process would
be), or called in-process with a ``Recorder`` as its ``send``. Shared by the proxy's, the Kubernetes and
the ASGI tests (the tests' root folder is on their path)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


def listening_socket() -> socket.socket:
    """A socket bound to a free port on 127.0.0.1 and already listening, so callers may connect at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@contextmanager
def serve_in_thread(server: uvicorn.Server, sock: socket.socket, stop_s: float = 10.0) -> Iterator[str]:
    """Run ``server`` on ``sock`` in a thread with its own event loop; yields its base URL. On the way out
    the server is asked to exit and given ``stop_s`` to do so."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=stop_s)
        sock.close()


class Recorder:
    """An ASGI ``send`` that keeps what the client would have received."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])
