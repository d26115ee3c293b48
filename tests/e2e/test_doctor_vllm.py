"""`pdserve doctor` against the real vLLM pair: a healthy pair passes with its transfer measured, and a
decode that cannot take the KV over fails with a message that says so and exit status 1."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from decode_front import decode_front
from pdserve import cli, httpclient
from pdserve.config import ProxyConfig
from pdserve.doctor.report import EXIT_COULD_NOT_RUN, EXIT_DOES_NOT_PAY, EXIT_FAILED, EXIT_HEALTHY
from pdserve.proxy.serving.thread import ProxyThread
from pdserve.stack import Stack

pytestmark = pytest.mark.vllm


@contextlib.contextmanager
def _proxy(prefill: str, decode: str, port: int) -> Iterator[ProxyThread]:
    proxy = ProxyThread(ProxyConfig.pd((prefill,), (decode,), port=port))
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
    dropped: list[tuple[str, dict[str, Any]]] = []

    def without_params(path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A decode started without a KV connector: the params never reach it, so it computes the
        prompt itself and pulls nothing. What it dropped is kept, to be handed on below."""
        dropped.append((path, body))
        return {k: v for k, v in body.items() if k != "kv_transfer_params"}

    try:
        with decode_front(decode, without_params) as (front, _), _proxy(prefill, front, 18040) as proxy:
            code, out = _doctor(capsys, proxy.url, "--logs", str(stack.run_dir))
    finally:
        # Hand the dropped params to the real decode: it pulls, and prefill frees the canary's KV now
        # rather than at its lease's end, while later tests watch prefill's KV usage.
        for path, body in dropped:
            httpclient.post_json(decode + path, body, 120)
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
