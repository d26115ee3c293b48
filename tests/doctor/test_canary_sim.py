"""doctor's canary on simulated instances behind a real proxy: its own cached-token count decides, so a
decode that does not report it fails the canary, whatever decode's counters (every client's) say."""

from __future__ import annotations

import pytest

from live_proxy import live_proxy
from pdserve import cli
from pdserve.doctor.report import EXIT_FAILED


def _doctor(capsys: pytest.CaptureFixture[str], url: str) -> tuple[int, str]:
    code = cli.main(["doctor", url])
    return code, capsys.readouterr().out


def test_a_canary_without_its_own_evidence_fails_though_the_counters_moved(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with live_proxy(num_prefill=1, num_decode=1, prompt_tokens_details=False) as live:
        code, out = _doctor(capsys, live.url)
    assert code == EXIT_FAILED, out
    assert "FAIL  canary: no usage.prompt_tokens_details.cached_tokens" in out
    assert "rose by 1" in out  # the counters did move: they do not decide


def test_a_canary_with_its_evidence_passes_on_a_fresh_prompt_of_several_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with live_proxy(num_prefill=1, num_decode=1, prompt_tokens_details=True) as live:
        code, out = _doctor(capsys, live.url)
    assert "PASS  canary: decode computed 0 of" in out, out
    assert "(32 tokens, mean Δ 0, max Δ 0" in out
    assert "FAIL" not in out and code != EXIT_FAILED
