"""The tools' HTTP: a server that takes the request and answers late is "no answer", never "cannot
reach"; a refused connection is "cannot reach"."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

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


def _unix_server(tmp_path: Path, answer: bytes | None) -> tuple[str, socket.socket]:
    """A Unix socket server that reads each request and sends ``answer`` (None: never answers)."""
    path = str(tmp_path / "worker.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            _read_request(conn)
            if answer is not None:
                conn.sendall(answer)
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return path, sock


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ]
    while len(body) < (lengths[0] if lengths else 0):
        body += conn.recv(65536)


def test_a_server_on_a_unix_socket_answers_as_any_other(tmp_path: Path) -> None:
    path, sock = _unix_server(tmp_path, b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
    with sock:
        assert httpclient.request_unix(path, "POST", "/_pdserve/event", b"{}").status == 204


def test_a_unix_socket_that_takes_the_request_and_never_answers_is_no_answer(tmp_path: Path) -> None:
    path, sock = _unix_server(tmp_path, None)
    with sock, pytest.raises(NoAnswer, match=r"no answer from unix:.*within 0\.3 s"):
        httpclient.request_unix(path, "GET", "/_pdserve/ready", timeout=0.3)


def test_a_unix_socket_nothing_listens_on_is_cannot_reach(tmp_path: Path) -> None:
    with pytest.raises(Unreachable, match="cannot reach unix:") as caught:
        httpclient.request_unix(str(tmp_path / "gone.sock"), "GET", "/_pdserve/ready")
    assert not isinstance(caught.value, NoAnswer)
