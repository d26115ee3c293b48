"""PNG plots of a comparison: latency CDFs per mode and rate, and TTFT/ITL against request rate.

matplotlib is optional (``pip install 'pdserve[bench]'``): without it ``write_plots`` returns no files
and says why, and the numbers are all in the report anyway. The Agg backend draws without a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.verdict import MODES, RatePair
from pdserve.bench.workload import rate_arg

_STYLE = {"disaggregated": "-", "colocated": "--"}
_CDF_PANELS = (("ttfts_ms", "TTFT"), ("itls_ms", "ITL"), ("e2els_ms", "E2E latency"))


def write_plots(pairs: Sequence[RatePair], out_dir: Path) -> tuple[list[Path], str | None]:
    """(the PNGs written, why none were if so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install 'pdserve[bench]'): no plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        written.append(out_dir / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(_CDF_PANELS), figsize=(5 * len(_CDF_PANELS), 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (field, title) in zip(axes, _CDF_PANELS, strict=True):
        for i, pair in enumerate(pairs):
            for mode in MODES:
                values = sorted(getattr(getattr(pair, mode).result, field))
                if not values:
                    continue
                ys = [(k + 1) / len(values) for k in range(len(values))]
                ax.step(values, ys, where="post", linestyle=_STYLE[mode], color=colors[i % len(colors)],
                        label=f"{mode} @{rate_arg(pair.rate)}")  # fmt: skip
        _label(ax, f"{title} CDF", "ms", "fraction of requests" if field != "itls_ms" else "fraction of gaps")
        ax.set_xscale("log")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize="small")
    save(fig, "latency-cdf.png")
    rates = [p.rate for p in pairs]
    if len(pairs) > 1 and all(math.isfinite(r) for r in rates):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, metric, title in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL")):
            for mode in MODES:
                for stat, marker in (("median", "o"), ("p90", "^")):
                    ys = [getattr(getattr(p, mode).result.latency(metric), stat) for p in pairs]
                    ax.plot(rates, ys, linestyle=_STYLE[mode], marker=marker, label=f"{mode} {stat}")
            _label(ax, f"{title} against request rate", "requests/s", "ms")
        axes[0].legend(fontsize="small")
        save(fig, "latency-vs-rate.png")
    return written, None


def _label(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
