"""The tools' HTTP: a server that takes the request and answers late is "no answer", never "cannot
reach"; a refused connection is "cannot reach"."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from pdserve import httpclient
from pdserve.errors import NoAnswer, Unreachable


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and reads requests, and never answers (a server deep in a queue)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    for conn in held:
        conn.close()


def test_a_late_answer_is_no_answer_not_cannot_reach(silent_server: str) -> None:
    with pytest.raises(NoAnswer) as caught:
        httpclient.post_json(f"{silent_server}/v1/completions", {"prompt": "x"}, timeout=0.3)
    assert "no answer from" in str(caught.value) and "cannot reach" not in str(caught.value)


def test_a_refused_connection_is_cannot_reach() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(Unreachable, match="cannot reach") as caught:
            httpclient.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert not isinstance(caught.value, NoAnswer)
