"""The elastic router's calibration: measured over predicted, per kind of placement."""

from __future__ import annotations

import math

import pytest

from pdserve.costmodel import Calibration
from pdserve.proxy.pool.calibrator import MIN_SAMPLES, Calibrator


def test_no_measurements_leave_the_model_as_it_is() -> None:
    assert Calibrator(64, 0.95).calibration() == Calibration()


def test_a_kind_counts_once_it_has_enough_requests_and_only_for_itself() -> None:
    calibrator = Calibrator(64, 0.95)
    firsts = [calibrator.observe(False, 8.0, 3.0) for _ in range(MIN_SAMPLES)]
    assert firsts == [False] * (MIN_SAMPLES - 1) + [True]  # the router re-plans once, at the first factors
    assert not calibrator.observe(False, 8.0, 3.0)
    calibration = calibrator.calibration()
    assert calibration.factors(False) == (8.0, 3.0)
    # Split was never measured: the model stays optimistic about it, so the pool tries it and measures.
    assert calibration.factors(True) == (1.0, 1.0)


def test_the_factor_is_the_quantile_the_slo_is_judged_at_of_the_last_requests() -> None:
    calibrator = Calibrator(20, 0.9)
    for ratio in [100.0] * 20:  # older than the last 20: forgotten
        calibrator.observe(True, ratio, ratio)
    for ratio in range(1, 21):
        calibrator.observe(True, float(ratio), 1.0)
    assert calibrator.calibration().factors(True) == (18.0, 1.0)
    assert calibrator.num_samples() == {"whole": 0, "split": 20}


@pytest.mark.parametrize("ratio", [math.nan, math.inf, 0.0, -1.0])
def test_broken_measurements_are_ignored(ratio: float) -> None:
    calibrator = Calibrator(64, 0.95)
    for _ in range(MIN_SAMPLES):
        calibrator.observe(False, ratio, 1.0)
    assert calibrator.num_samples()["whole"] == 0


def test_factors_are_bounded() -> None:
    calibrator = Calibrator(64, 0.95)
    for _ in range(MIN_SAMPLES):
        calibrator.observe(False, 1e6, 1e-6)
    ttft, tpot = calibrator.calibration().factors(False)
    assert ttft == 50.0 and tpot == 0.05
