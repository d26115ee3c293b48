"""How far the elastic router's predictions are from what its requests measure, per kind of placement.

The cost model predicts from step costs (a profile's, measured on one GPU with the instances on their
own): on another GPU, with the pool's instances sharing one, or under arrivals in bursts, its TTFT and
TPOT can be off by several times, and a layout it believes meets the SLO may miss it on every request
(one H100, both instances on it: colocated predicted 6.7 ms TPOT, measured 18.3). The router tells
the calibrator, for each stream that ended, what was measured over what was predicted; at each re-plan
the calibrator answers with factors (costmodel.Calibration): the quantile of those ratios the SLO is
judged at, over each kind's last ``num_samples`` requests. A kind keeps what it last measured while the
pool does not use it: forgotten by age, the layout it ruled out would look good again, be tried, and
fail its requests once more. A kind not measured yet keeps the model as it is: optimistic, so that a
layout the model favours is tried and measured rather than ruled out by the other kind's factors
(sharing one GPU slows colocated steps more than split ones). A kind measured at start-up (a lone
request of each kind, proxy/pool/startup.py) starts from those factors instead, until its own requests
number ``MIN_SAMPLES``: the first requests are placed by what these instances measured, not by the
profile of another GPU.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pdserve.costmodel import Calibration

MIN_SAMPLES = 8  # ratios a kind needs before its factors count
_BOUNDS = (0.05, 50.0)  # a factor beyond these says the measurement is broken, not the model


@dataclass(frozen=True)
class _Ratio:
    ttft: float
    tpot: float


class Calibrator:
    """The one owner of the measured-over-predicted ratios of recent requests."""

    def __init__(self, num_samples: int, quantile: float) -> None:
        self._quantile = quantile
        self._ratios: dict[bool, deque[_Ratio]] = {
            False: deque(maxlen=num_samples),
            True: deque(maxlen=num_samples),
        }
        self._priors: dict[bool, _Ratio] = {}  # measured at start-up, per kind

    def prior(self, is_split: bool, ratio_ttft: float, ratio_tpot: float) -> bool:
        """What a start-up measurement of the kind found: its factors until its own requests count."""
        if not (ratio_ttft > 0 and ratio_tpot > 0 and math.isfinite(ratio_ttft + ratio_tpot)):
            return False
        self._priors[is_split] = _Ratio(_bounded(ratio_ttft), _bounded(ratio_tpot))
        return True

    def sources(self) -> dict[str, str]:
        """Where each kind's factors come from now: its requests, the start-up measurement, or the model."""
        return {
            kind: "requests" if len(self._ratios[split]) >= MIN_SAMPLES
            else "startup" if split in self._priors else "model"
            for kind, split in (("whole", False), ("split", True))
        }  # fmt: skip

    def observe(self, is_split: bool, ratio_ttft: float, ratio_tpot: float) -> bool:
        """A request placed whole (or split) measured ``ratio_*`` times its predicted TTFT and TPOT;
        True when that gave the kind its first factors."""
        if not (ratio_ttft > 0 and ratio_tpot > 0 and math.isfinite(ratio_ttft + ratio_tpot)):
            return False  # NaN included
        ratios = self._ratios[is_split]
        ratios.append(_Ratio(ratio_ttft, ratio_tpot))
        return len(ratios) == MIN_SAMPLES

    def calibration(self) -> Calibration:
        """The factors now: each kind's own once it has ``MIN_SAMPLES`` ratios."""
        whole, split = (self._factors(kind) for kind in (False, True))
        return Calibration(*whole, *split)

    def num_samples(self) -> dict[str, int]:
        return {"whole": len(self._ratios[False]), "split": len(self._ratios[True])}

    def _factors(self, is_split: bool) -> tuple[float, float]:
        ratios = self._ratios[is_split]
        if len(ratios) < MIN_SAMPLES:
            prior = self._priors.get(is_split)
            return (prior.ttft, prior.tpot) if prior is not None else (1.0, 1.0)
        return _bounded(_quantile([r.ttft for r in ratios], self._quantile)), _bounded(
            _quantile([r.tpot for r in ratios], self._quantile)
        )


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _bounded(factor: float) -> float:
    low, high = _BOUNDS
    return min(high, max(low, factor))
