"""Ordinary least squares for a handful of unknowns, without numpy (pdserve's venv has none).

Calibration fits at most three coefficients, so the normal equations ``(XᵀX) b = Xᵀy`` solved by Gaussian
elimination with partial pivoting are exact enough and a few lines long. Ill-conditioning shows up as a
near-zero pivot, which is reported rather than turned into huge coefficients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_SINGULAR = 1e-10  # pivot (columns scaled to unit norm) below which a column is a combination of others


@dataclass(frozen=True)
class Fit:
    coefficients: tuple[float, ...]  # one per column of the design matrix
    r_squared: float  # 1 − SS_res/SS_tot; 1.0 when y has no variance and the fit is exact
    rmse: float  # root mean square residual, in y's unit

    def predict(self, row: Sequence[float]) -> float:
        return sum(c * x for c, x in zip(self.coefficients, row, strict=True))


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> Fit:
    """Coefficients b minimising Σ (row·b − y)²; ValueError if there are too few rows or a column is redundant."""
    if len(rows) != len(ys):
        raise ValueError(f"{len(rows)} rows but {len(ys)} observations")
    if not rows:
        raise ValueError("no observations to fit")
    k = len(rows[0])
    if any(len(r) != k for r in rows):
        raise ValueError("rows of the design matrix differ in length")
    if len(rows) < k:
        raise ValueError(f"{len(rows)} observations cannot determine {k} unknowns")
    # Columns scaled to unit norm first: an intercept column of ones next to one of context tokens (~1e4)
    # would otherwise square a condition number that is already large.
    norms = [math.sqrt(sum(r[j] * r[j] for r in rows)) for j in range(k)]
    if any(n == 0 for n in norms):
        raise ValueError(f"column {norms.index(0.0)} of the design matrix is all zeros")
    x = [[v / n for v, n in zip(r, norms, strict=True)] for r in rows]
    # Augmented normal-equation matrix [XᵀX | Xᵀy]; its diagonal is all ones after scaling.
    a = [
        [sum(r[i] * r[j] for r in x) for j in range(k)] + [sum(r[i] * y for r, y in zip(x, ys, strict=True))]
        for i in range(k)
    ]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) <= _SINGULAR:
            raise ValueError(f"column {col} of the design matrix is (nearly) a combination of the others")
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(col + 1, k):
            factor = a[i][col] / a[col][col]
            for j in range(col, k + 1):
                a[i][j] -= factor * a[col][j]
    coef = [0.0] * k
    for i in reversed(range(k)):
        coef[i] = (a[i][k] - sum(a[i][j] * coef[j] for j in range(i + 1, k))) / a[i][i]
    coef = [c / n for c, n in zip(coef, norms, strict=True)]
    residuals = [y - sum(c * x for c, x in zip(coef, r, strict=True)) for r, y in zip(rows, ys, strict=True)]
    ss_res = sum(e * e for e in residuals)
    mean_y = sum(ys) / len(ys)
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    r_squared = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return Fit(tuple(coef), r_squared, math.sqrt(ss_res / len(ys)))


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (q=0.5 is the median)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    return ordered[low] + (ordered[min(low + 1, len(ordered) - 1)] - ordered[low]) * (pos - low)
