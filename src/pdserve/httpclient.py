"""Blocking HTTP for pdserve's command-line tools and the launcher: one opener, never ``$http_proxy``, and
``request_unix`` for a server on a Unix socket (the launcher's word to each worker of a proxy of several).

The instances pdserve talks to are local or on the cluster network; sending a health check or a verify
request through a corporate proxy from the environment would only make it fail slowly. (The proxy's
upstream calls go through its own HTTP/1.1 client, proxy/wire/client.py, which reads no environment; the
aiohttp sessions of the simulator and the measurement clients ignore ``$http_proxy`` unless told to trust it.)
urllib's exceptions become ``Unreachable`` here and nowhere else; an answer that is only late (the
connection made, the request sent) is ``NoAnswer``, one of them, so a queue never reads "cannot reach".
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.errors import NoAnswer, Unreachable

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON, or its text when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return self.body.decode("utf-8", "replace")


def request(
    url: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    method: str | None = None,
) -> Response:
    """GET (no body) or POST; any HTTP status is a Response, an unreachable server ``Unreachable``."""
    req = urllib.request.Request(url, data=body, headers=dict(headers or {}), method=method)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return Response(resp.status, _lower(resp.headers.items()), resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return Response(exc.code, _lower(exc.headers.items()), exc.read())
    except TimeoutError as exc:  # urllib wraps a connect timeout in URLError: this one came after the send
        raise NoAnswer(
            f"no answer from {url} within {timeout:g} s (it took the request: busy or stuck)"
        ) from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError is an OSError
        raise Unreachable(f"cannot reach {url}: {exc}") from exc


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def request_unix(
    path: str, method: str, target: str, body: bytes | None = None, timeout: float = 2.0
) -> Response:
    """``request``, to the server on the Unix socket ``path``; a body is JSON."""
    where = f"unix:{path}"
    conn = _UnixConnection(path, timeout)
    try:
        try:
            conn.connect()
        except OSError as exc:
            raise Unreachable(f"cannot reach {where}: {exc}") from exc
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, target, body=body, headers=headers)
        resp = conn.getresponse()
        return Response(resp.status, _lower(resp.getheaders()), resp.read())
    except TimeoutError as exc:
        raise NoAnswer(
            f"no answer from {where} within {timeout:g} s (it took the request: busy or stuck)"
        ) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise Unreachable(f"cannot reach {where}: {exc}") from exc
    finally:
        conn.close()


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {k.lower(): v for k, v in items}


def get(url: str, timeout: float = 30.0) -> Response:
    return request(url, timeout=timeout)


def post_json(
    url: str, data: Any, timeout: float = 120.0, headers: Mapping[str, str] | None = None
) -> Response:
    return request(
        url,
        json.dumps(data).encode(),
        {"Content-Type": "application/json", **(headers or {})},
        timeout,
    )


def is_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        return get(url, timeout).status == 200
    except Unreachable:
        return False
