from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pdserve.cli import main
from pdserve.commands.proofpath import Reference
from pdserve.commands.verify import Answer, Report, _read_stream, ask, cases, check_answer, verify
from pdserve.kvproof import BF16, Evidence


def test_stream_text_is_joined_from_deltas() -> None:
    raw = (
        'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
        'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
        'data: {"choices": [{"delta": {"content": "lo"}}]}\n\n'
        "data: [DONE]\n\n"
    )
    answer = _read_stream(200, raw.encode(), "rid")
    assert (answer.text, answer.error) == ("Hello", None)


def test_stream_error_event_fails_even_with_status_200() -> None:
    raw = 'data: {"choices": [{"text": "a"}]}\n\ndata: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    answer = _read_stream(200, raw.encode(), None)
    assert answer.error is not None and "boom" in answer.error


def test_stream_without_done_is_an_error_not_a_short_answer() -> None:
    answer = _read_stream(200, b'data: {"choices": [{"text": "a"}]}\n\n', None)
    assert answer.error == "stream ended without [DONE]"


def test_cases_cover_both_endpoints_streamed_and_not_with_unique_prompts() -> None:
    first, second = cases("m"), cases("m")
    assert {(path, body["stream"]) for _, path, body in first} == {
        ("/v1/completions", False),
        ("/v1/completions", True),
        ("/v1/chat/completions", False),
        ("/v1/chat/completions", True),
    }
    assert first[0][2]["prompt"] != second[0][2]["prompt"]


def test_report_fails_when_any_check_fails_and_when_empty() -> None:
    report = Report()
    assert not report.ok
    report.check(True, "a")
    assert report.ok
    report.check(False, "b")
    assert not report.ok
    assert report.lines() == ["  PASS  a", "  FAIL  b"]


class _Proxy(http.server.BaseHTTPRequestHandler):
    """A proxy's GET /instances listing ``self.server.instances``; every path asked for is recorded."""

    server: _ProxyServer

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        body = json.dumps(self.server.instances if self.path == "/instances" else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        return None


class _ProxyServer(http.server.ThreadingHTTPServer):
    def __init__(self, instances: list[dict[str, Any]]) -> None:
        super().__init__(("127.0.0.1", 0), _Proxy)
        self.instances = instances
        self.paths: list[str] = []


@contextmanager
def _proxy_listing(instances: list[dict[str, Any]]) -> Iterator[_ProxyServer]:
    server = _ProxyServer(instances)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def _instance(role: str, port: int) -> dict[str, Any]:
    return {"role": role, "url": f"http://127.0.0.1:{port}", "healthy": True}


@pytest.mark.parametrize(
    ("instances", "failed"),
    [
        ([_instance("decode", 1)], ["the proxy lists 0 prefill instance(s)"]),
        ([_instance("prefill", 1)], ["the proxy lists 0 decode instance(s)"]),
        ([], ["the proxy lists 0 prefill instance(s)", "the proxy lists 0 decode instance(s)"]),
    ],
)
def test_verify_fails_loudly_when_the_proxy_has_no_prefill_or_no_decode(
    instances: list[dict[str, Any]], failed: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with _proxy_listing(instances) as proxy:
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        report = verify(url, say=lambda _line: None)
        assert not report.ok
        assert [what for ok, what in report.checks if not ok] == failed
        assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "verify: FAILED" in out and all(f"FAIL  {what}" in out for what in failed)
    # Nothing could prove PD, so nothing was sent: no request, no counter read, only the listing.
    assert proxy.paths == ["/instances", "/instances"]


def test_a_stream_that_moved_mid_way_is_unprovable_not_blamed_on_a_flag() -> None:
    report = Report()
    answer = Answer(200, "text", request_id="verify-x-1", evidence=Evidence(prompt_tokens=900))
    moved = "from http://d0 after 12 tokens to http://d1"
    check_answer(
        report, "chat, streamed", answer, Reference("http://unused", "decode"), "m", BF16, None, moved
    )
    [(ok, what)] = [c for c in report.checks if "moved" in c[1]]
    assert not ok and "[verify-x-1]" in what and "http://d1" in what
    assert not any("--enable-prompt-tokens-details" in what for _, what in report.checks)


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every POST 503, without echoing the request id (as a load balancer in front might)."""

    def do_POST(self) -> None:
        body = b'{"error": {"message": "no instance available"}}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return None


def test_a_refused_request_keeps_its_request_id_in_the_failure() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        answer = ask(
            f"http://127.0.0.1:{server.server_address[1]}", "/v1/completions", {}, request_id="verify-a-0"
        )
    finally:
        server.shutdown()
        server.server_close()
    report = Report()
    check_answer(report, "completions", answer, Reference("http://unused", "decode"), "m", BF16)
    [(ok, what)] = report.checks
    assert not ok and what.startswith("completions [verify-a-0]: HTTP 503") and "no instance" in what
