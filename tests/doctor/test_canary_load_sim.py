"""doctor's canary on a slow simulated pair that other clients keep saturated: it waits its turn, says
so and passes; on a decode that stopped stepping it fails naming the stall, not "cannot reach"."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.doctor.report import EXIT_FAILED, render
from pdserve.doctor.run import diagnose
from pdserve.patience import Waiting
from slow_pair import heavy_traffic, slow_pair


def _doctor(capsys: pytest.CaptureFixture[str], url: str, *flags: str) -> tuple[int, str, str]:
    code = cli.main(["doctor", url, *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_canary_beside_heavy_traffic_waits_its_turn_says_so_and_passes() -> None:
    said: list[str] = []
    with slow_pair() as pair, heavy_traffic(pair):
        report = diagnose(pair.url, say=said.append, waiting=Waiting(poll_s=0.2, say_every_s=1.0))
    lines = "\n".join(render(report))
    assert report.exit_code != EXIT_FAILED and "PASS  canary: decode computed 0 of" in lines, lines
    queued = [line for line in said if line.startswith("doctor-") and "queued behind" in line]
    assert queued and f"at decode {pair.decode} (running 2, waiting" in " ".join(queued), said


def test_a_canary_on_a_stalled_decode_fails_naming_the_stall(capsys: pytest.CaptureFixture[str]) -> None:
    with slow_pair() as pair:
        pair.stall_decode(20)
        code, out, _ = _doctor(capsys, pair.url, "--stall-after", "3")
    assert code == EXIT_FAILED, out
    assert "stalled: nothing moved for" in out and f"decode {pair.decode}" in out, out
    assert "cannot reach" not in out
