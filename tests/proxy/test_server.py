"""The parts of uvicorn that are not its public API and that pdserve relies on, checked by name.

The proxy's server subclasses uvicorn's ``HttpToolsProtocol`` to cork each connection's writes
(``CorkedTransport``), and the simulator closes a connection without an answer through
``send.__self__.transport`` (``Writer.drop``). A uvicorn release may change either without notice;
pyproject.toml pins uvicorn to the minor release these tests passed on. When one of them fails after an
upgrade, its message names what changed: adapt server.py or wire.py, then move the pin.
"""

from __future__ import annotations

import ast
import inspect
import socket
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import uvicorn
import uvicorn.protocols.http.flow_control as uvicorn_flow_control
import uvicorn.protocols.http.httptools_impl as uvicorn_httptools
import uvicorn.protocols.utils as uvicorn_utils
from packaging.requirements import Requirement
from proxy_rig import listening_socket, serve_in_thread
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.proxy.serving.server import CorkedTransport, _CorkedHttpToolsProtocol
from pdserve.sim.wire import drop_unanswered

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# What uvicorn's HTTP protocol, its flow control and its address helpers call on a connection's
# transport (uvicorn 0.55). CorkedTransport holds back what ``write`` gives it, so every method that
# writes, closes or hands the connection over must flush first: it implements those; the rest it passes
# through to the real transport unchanged, which is right only for methods that neither write nor close.
CORKED = {"write", "close", "set_protocol"}
PASSED_THROUGH = {"is_closing", "get_extra_info", "pause_reading", "resume_reading"}


def _uvicorn_requirement() -> Requirement:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == "uvicorn")


def test_installed_uvicorn_is_the_release_pyproject_pins() -> None:
    pinned, installed = _uvicorn_requirement(), version("uvicorn")
    assert pinned.specifier.contains(installed), (
        f"uvicorn {installed} is installed but pyproject.toml pins {pinned}: run tests/proxy/test_server.py "
        f"against it, adapt proxy/serving/server.py and sim/wire.py if it fails, then move the pin"
    )
    upper = [s for s in pinned.specifier if s.operator == "<"]
    assert upper, f"pyproject.toml's {pinned} has no upper bound: uvicorn's internals change between minors"


def test_httptools_protocol_still_takes_the_transport_in_connection_made() -> None:
    params = list(inspect.signature(HttpToolsProtocol.connection_made).parameters)
    assert params == ["self", "transport"], (
        f"uvicorn's HttpToolsProtocol.connection_made now takes {params}; _CorkedHttpToolsProtocol in "
        f"proxy/serving/server.py overrides it with (self, transport) to wrap the transport"
    )
    assert "self.loop = " in inspect.getsource(HttpToolsProtocol.__init__), (
        "uvicorn's HttpToolsProtocol no longer sets self.loop in __init__; _CorkedHttpToolsProtocol in "
        "proxy/serving/server.py reads it to schedule CorkedTransport's flush"
    )


def _transport_methods_called(module: Any) -> set[str]:
    """Names ``x`` in ``transport.x`` / ``self.transport.x`` / ``self._transport.x`` in a module's source."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        owner_name = (
            owner.id
            if isinstance(owner, ast.Name)
            else owner.attr
            if isinstance(owner, ast.Attribute)
            else ""
        )
        if owner_name in ("transport", "_transport"):
            names.add(node.attr)
    return names


def test_uvicorn_calls_on_the_transport_only_what_the_cork_handles() -> None:
    called = set().union(
        *(_transport_methods_called(m) for m in (uvicorn_httptools, uvicorn_flow_control, uvicorn_utils))
    )
    unknown = called - CORKED - PASSED_THROUGH
    assert not unknown, (
        f"uvicorn now calls transport.{', transport.'.join(sorted(unknown))} on a connection; CorkedTransport "
        f"(proxy/serving/server.py) passes those straight to the real transport, ahead of writes it still holds: "
        f"flush first in CorkedTransport if they write or close, then add them to this test's sets"
    )
    assert all(callable(getattr(CorkedTransport, name, None)) for name in CORKED)


def _raw_get(port: int, path: str) -> bytes:
    """Everything the server sends for one request before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def test_a_real_uvicorn_corks_the_proxy_and_lets_the_simulator_drop_a_connection() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/drop":
            await drop_unanswered(send, receive)
            return
        seen["transport"] = getattr(getattr(send, "__self__", None), "transport", None)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, http=_CorkedHttpToolsProtocol, lifespan="off", log_config=None,
                            log_level="warning", timeout_graceful_shutdown=1)  # fmt: skip
    sock = listening_socket()
    port = sock.getsockname()[1]
    with serve_in_thread(uvicorn.Server(config), sock):
        answer = _raw_get(port, "/")
        dropped = _raw_get(port, "/drop")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nok"), answer
    assert isinstance(seen["transport"], CorkedTransport), (
        f"the ASGI send callable is {type(seen.get('transport'))}'s, not bound to a request cycle whose "
        f".transport is proxy/serving/server.py's CorkedTransport: uvicorn changed how send, its cycle or "
        f"connection_made hold the transport (sim/wire.py's Writer.drop reaches send.__self__.transport)"
    )
    assert dropped == b"", (
        f"a simulated dying process answered {dropped[:40]!r} instead of closing the connection: "
        f"sim/wire.py's Writer.drop found no send.__self__.transport under uvicorn {version('uvicorn')}"
    )


def test_httptools_protocol_still_has_what_the_client_deadlines_hook_into() -> None:
    """_CorkedHttpToolsProtocol sets its deadlines in these parser callbacks, sweeps uvicorn's set of open
    connections, and reads the cycle's state to decide whether a 408 may be written (proxy/serving/server.py)."""
    for name in ("on_message_begin", "on_headers_complete", "on_message_complete"):
        assert callable(getattr(HttpToolsProtocol, name, None)), (
            f"uvicorn's HttpToolsProtocol has no {name} now; proxy/serving/server.py's client deadlines hook into it"
        )
    init = inspect.getsource(HttpToolsProtocol.__init__)
    assert "self.connections = " in init and "self.cycle" in init, (
        "uvicorn's HttpToolsProtocol no longer keeps self.connections/self.cycle; proxy/serving/server.py's "
        "connection cap and 408 read them"
    )
    cycle_init = inspect.getsource(uvicorn_httptools.RequestResponseCycle.__init__)
    assert "self.response_started" in cycle_init and "self.response_complete" in cycle_init, (
        "uvicorn's RequestResponseCycle no longer has response_started/response_complete; proxy/serving/server.py "
        "reads them so that a 408 never interrupts an answer being written"
    )
