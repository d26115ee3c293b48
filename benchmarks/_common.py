"""What the benchmark scripts share: their command line, and the RESULT line by which a script hands its
figures to the one that ran it (gpu_run.py runs the others; nixl_transfer.py runs itself per role).

Standard library only: nixl_transfer.py runs under a python that has torch and NIXL but maybe not
pdserve. A script imports this as ``_common``, found next to it (Python puts a script's folder first on
its path).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_RESULT = "RESULT "


def script_parser(
    doc: str | None, numbers: Mapping[str, int | float] | None = None
) -> argparse.ArgumentParser:
    """A benchmark's command line, its module docstring (as written) the --help, with the options that
    each take one number added first (``add_numbers``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_numbers(parser, numbers or {})
    return parser


def add_numbers(parser: argparse.ArgumentParser, numbers: Mapping[str, int | float]) -> None:
    """Options that each take one number, flag -> default, in this order; the default's type is the
    option's (``2`` an int, ``15.0`` a float)."""
    for flag, default in numbers.items():
        parser.add_argument(flag, type=type(default), default=default)


def print_result(figures: Any) -> None:
    """Hand ``figures`` to the script that runs this one: the last RESULT line of the output is read."""
    print(_RESULT + json.dumps(figures), flush=True)


def read_result(output: str) -> Any:
    """What the last RESULT line in a script's output holds; None where there is none."""
    found = [line for line in output.splitlines() if line.startswith(_RESULT)]
    return json.loads(found[-1][len(_RESULT) :]) if found else None


def is_result(line: str) -> bool:
    return line.startswith(_RESULT)


def instructions_per_unit(run: Callable[[int, str], object], short: int = 300, long: int = 1300) -> float:
    """Instructions valgrind counts per unit of work: ``run(n, callgrind_out)`` does ``n`` units under
    callgrind at ``short`` and ``long``, and the difference is divided out, so start-up cancels."""
    totals = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (short, long):
            out = Path(tmp) / f"cg.{n}"
            run(n, str(out))
            summary = [line for line in out.read_text().splitlines() if line.startswith("summary:")]
            totals.append(int(summary[0].split()[1]))
    return (totals[1] - totals[0]) / (long - short)
