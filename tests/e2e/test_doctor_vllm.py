"""`pdserve doctor` against the real vLLM pair: a healthy pair passes with its transfer measured, and a
decode that cannot take the KV over fails with a message that says so and exit status 1."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pdserve import cli, httpclient
from pdserve.config import ProxyConfig
from pdserve.doctor.report import EXIT_COULD_NOT_RUN, EXIT_DOES_NOT_PAY, EXIT_FAILED, EXIT_HEALTHY
from pdserve.proxy.serving.thread import ProxyThread
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm


class _ParamsDroppingDecode(ThreadingHTTPServer):
    """A stand-in for a decode started without a KV connector: it serves every request with the real
    decode, but ``kv_transfer_params`` never reach it, so decode computes the prompt itself and pulls
    nothing. It keeps what it dropped, so the test can hand it on and free prefill's lease at once."""

    def __init__(self, port: int, target: str) -> None:
        self.target = target
        self.dropped: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", port), _Relay)


class _Relay(BaseHTTPRequestHandler):
    server: _ParamsDroppingDecode

    def _answer(self, response: httpclient.Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        self.wfile.write(response.body)

    def do_GET(self) -> None:
        self._answer(httpclient.get(self.server.target + self.path, 30))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        params = body.pop("kv_transfer_params", None)
        if params:
            self.server.dropped.append({"path": self.path, "body": body, "params": params})
        self._answer(httpclient.post_json(self.server.target + self.path, body, 120))

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _proxy(prefill: str, decode: str, port: int) -> Iterator[ProxyThread]:
    proxy = ProxyThread(ProxyConfig(prefill_urls=(prefill,), decode_urls=(decode,), port=port))
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["doctor", *args])
    return code, capsys.readouterr().out


def test_doctor_passes_on_the_real_pair_and_measures_the_transfer(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _doctor(capsys, stack.proxy_url, "--logs", str(stack.run_dir), "--json")
    report = json.loads(out)
    [pair] = report["pairs"]
    failed = [c["what"] for c in pair["checks"] if c["status"] == "fail"]
    # Whether the split pays is a timing verdict (one canary's pull against a ~1,000-token prefill of the
    # tiny model, on two shared cores): either may come out, and the exit status must say which.
    verdict = pair["verdict"]
    assert failed == [] and code == (EXIT_HEALTHY if verdict["pays"] else EXIT_DOES_NOT_PAY), (
        code,
        failed,
        report["summary"],
    )
    handoff = pair["handoff"]
    assert handoff["num_transfers"] == 1 and handoff["num_failed"] == 0
    assert handoff["bytes"] > 0 and handoff["bandwidth_bytes_per_s"] > 0
    assert handoff["prompt_tokens"] >= 1000, "the canary prompt should be large enough to mean something"
    # The logs were found and read: the facts HTTP does not give are known.
    checks = " | ".join(c["what"] for c in pair["checks"])
    assert "dtype agrees: float32" in checks and "KV layout agrees" in checks
    assert pair["transport"].startswith("NIXL backend UCX")
    assert "KV moves at" in verdict["lines"][0] and "to prefill here" in verdict["lines"][0]


def test_doctor_fails_clearly_when_decode_does_not_pull_the_kv(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    [prefill], [decode] = stack.urls("prefill"), stack.urls("decode")
    fake = _ParamsDroppingDecode(18042, decode)
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        with _proxy(prefill, "http://127.0.0.1:18042", 18040) as proxy:
            code, out = _doctor(capsys, proxy.url, "--logs", str(stack.run_dir))
    finally:
        fake.shutdown()
        # Hand the dropped params to the real decode: it pulls, and prefill frees the canary's KV now
        # rather than at its lease's end, while later tests watch prefill's KV usage.
        for dropped in fake.dropped:
            body = {**dropped["body"], "kv_transfer_params": dropped["params"]}
            httpclient.post_json(decode + dropped["path"], body, 120)
    assert code == EXIT_FAILED, out
    assert "FAIL  decode's transfer counter (vllm:nixl_xfer_time_seconds_count) rose by 0" in out
    assert "decode answered without pulling the KV" in out
    assert out.rstrip().splitlines()[-1].startswith("doctor: FAILED")


def test_doctor_fails_on_an_unreachable_decode_and_cannot_run_without_a_proxy(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    with _proxy(stack.urls("prefill")[0], "http://127.0.0.1:18049", 18041) as proxy:
        code, out = _doctor(capsys, proxy.url)
    assert code == EXIT_FAILED
    assert "FAIL  decode http://127.0.0.1:18049: cannot reach" in out
    # An instance is not a proxy: doctor says so and exits 2 (could not run).
    code = cli.main(["doctor", stack.urls("decode")[0]])
    assert code == EXIT_COULD_NOT_RUN
    assert "is this a pdserve proxy?" in capsys.readouterr().err
