"""The other workers of a multi-process proxy (workers.py), as one worker asks them.

Every worker serves the same app on the shared TCP port and on a Unix socket of its own in a private
directory. A request that comes in over a Unix socket is a peer's (``is_peer``): it is answered from
that worker's own state and never passed on. So what a client reads of the proxy (/metrics, /instances,
/requests, /admin/ledger) is the answering worker's state merged with its peers', and what the admin API
changes, every worker changes. Two things travel between workers unasked: what the launcher tells the
proxy (workers.py delivers it to each), and the prefix index's new entries (``share_pick``), in batches,
so that a prompt-aware policy in one worker knows where the others sent a prefix.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import httptools
import orjson

from pdserve.asgi import Scope
from pdserve.config import Role

log = logging.getLogger("pdserve.proxy")

PEER_TIMEOUT_S = 2.0
_GOSSIP_S = 0.1  # how stale one worker's view of another's prefix index may be
_MAX_PICKS = 10_000  # picks kept for the next batch; beyond it the oldest go (the index is an estimate)


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")


def is_peer(scope: Scope) -> bool:
    """Whether the request came over a worker's Unix socket (uvicorn gives such a server no port)."""
    server = scope.get("server")
    return server is not None and server[1] is None


class _Answer:
    """httptools' callbacks for one response read to its end."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.is_complete = False

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self.is_complete = True


def parse_response(raw: bytes) -> tuple[int, bytes]:
    """(status, body) of one whole HTTP/1.1 response; ValueError if it is cut short or not HTTP."""
    answer = _Answer()
    parser = httptools.HttpResponseParser(answer)
    try:
        parser.feed_data(raw)
    except httptools.HttpParserError as exc:
        raise ValueError(f"not an HTTP answer: {exc}") from None
    if not answer.is_complete:
        raise ValueError("the answer was cut short")
    return parser.get_status_code(), b"".join(answer.parts)


def request_bytes(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: pdserve-worker", "Connection: close",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Peers:
    """The workers other than this one (``index`` of ``count``), over their Unix sockets."""

    def __init__(self, directory: str, index: int, count: int, timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.directory = directory
        self.index = index
        self.count = count
        self._timeout_s = timeout_s
        self._paths = [socket_path(directory, i) for i in range(count) if i != index]
        self._picks: list[dict[str, Any]] = []

    async def ask(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> list[tuple[int, bytes]]:
        """Every peer's answer; one that does not answer in time is left out (and logged): a read then
        shows fewer workers' state, never blocks on a stuck one."""
        request = request_bytes(method, path, body, headers or {})
        results = await asyncio.gather(
            *(self._ask_one(p, request) for p in self._paths), return_exceptions=True
        )
        answers = []
        for sock, result in zip(self._paths, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "worker %d: no answer from %s for %s %s: %r", self.index, sock, method, path, result
                )
            else:
                answers.append(result)
        return answers

    async def bodies(self, path: str, headers: Mapping[str, str] | None = None) -> list[bytes]:
        """The bodies of the peers' 200 answers to GET ``path``."""
        return [body for status, body in await self.ask("GET", path, b"", headers) if status == 200]

    async def _ask_one(self, sock: str, request: bytes) -> tuple[int, bytes]:
        async with asyncio.timeout(self._timeout_s):
            reader, writer = await asyncio.open_unix_connection(sock)
            try:
                writer.write(request)
                raw = await reader.read()  # to the end: Connection: close
            finally:
                writer.close()
        return parse_response(raw)

    # --- the prefix index's entries, shared ------------------------------------------------------

    def share_pick(self, role: Role, url: str, hashes: Sequence[int]) -> None:
        """This worker sent a prompt with these block hashes to ``url``: the others learn it soon."""
        self._picks.append({"role": role, "url": url, "hashes": list(hashes)})
        if len(self._picks) > _MAX_PICKS:
            del self._picks[: len(self._picks) - _MAX_PICKS]

    async def run(self) -> None:
        """Send the picks of each ``_GOSSIP_S`` to the peers, until cancelled."""
        while True:
            await asyncio.sleep(_GOSSIP_S)
            if self._picks:
                batch, self._picks = self._picks, []
                await self.ask("POST", "/_pdserve/prefix", orjson.dumps(batch))
