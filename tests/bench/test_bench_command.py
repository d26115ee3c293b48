"""`pdserve plan` and `pdserve bench` as a user types them: what they print and their exit status; and
one small `bench --compare` end to end on the simulator (vLLM's benchmark client against sim instances,
~25 s, most of it importing that client)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from test_bench_plots import png_size

from pdserve.bench.evidence import RunEvidence
from pdserve.bench.result import BenchResult, Latency
from pdserve.bench.runner import CompareReport, write_summary
from pdserve.bench.verdict import Arm, RatePair, decide
from pdserve.bench.workload import Workload
from pdserve.cli import main
from pdserve.topology import Topology

PLAN = ["plan", "--profile", "llama3-8b-a100", "--rate", "5", "--input-len", "4096", "--output-len", "64",
        "--slo", "ttft:1000", "tpot:20"]  # fmt: skip


def test_plan_prints_the_ratio_and_the_numbers_behind_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(PLAN) == 0
    text = capsys.readouterr().out
    assert (
        "one prompt: prefill 288.0 ms on an idle instance; its KV 536.9 MB, 27.9 ms to move at 19.97 GB/s"
        in text
    )
    assert text.rstrip().endswith("plan: DISAGGREGATE 2P1D (P:D = 2:1)")


def test_plan_over_a_slow_link_advises_colocation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--kv-gbps", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "1074.7 ms to move at 0.50 GB/s" in text
    assert re.search(r"^plan: COLOCATE \d+ instances?: splitting does not pay here$", text, re.M)


def test_plan_that_nothing_can_meet_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN[:-2], "ttft:50", "tpot:5"]) == 1
    assert "plan: neither layout meets these SLOs" in capsys.readouterr().out


def test_plan_check_simulates_the_plan_and_its_neighbours(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", "llama3-8b-a100", "--rate", "2", "--input-len", "2048", "--output-len", "16",
            "--slo", "ttft:600", "tpot:30", "--check", "--check-requests", "100"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    chosen = re.search(r"^plan: (?:DISAGGREGATE (\d+)P(\d+)D|COLOCATE (\d+) instances?)", text, re.M)
    assert chosen, text
    runs = re.findall(r"^  (\S+(?: colocated)?) +goodput +([\d.]+) req/s, +([\d.]+) per instance", text, re.M)
    assert len(runs) >= 4
    assert len(re.findall(r"<- the plan$", text, re.M)) == 1
    assert "on the simulator (virtual clock, 100 Poisson requests):" in text


def _result(label: str, completed: int = 10) -> BenchResult:
    lat = Latency(100.0, 100.0, 150.0, 200.0)
    return BenchResult(
        label, math.inf, 2, completed, 0, 5.0, 2.0, 100.0, None, 2048.0, 64.0, lat, lat, lat, lat
    )


def _compare_dir(tmp_path: Path, num_transfers: int, seconds: float, size: float) -> Path:
    evidence = RunEvidence(num_transfers, 0, seconds, size, {"prefill": 150.0}, {})
    pair = RatePair(math.inf, Arm("disaggregated", _result("d"), evidence), Arm("colocated", _result("c")))
    write_summary(CompareReport((pair,), decide([pair]), (), tmp_path), Topology(), Workload())
    return tmp_path


def test_plan_from_a_bench_run_uses_its_measured_bandwidth_and_lengths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 10 transfers of 268 MB (2,048 tokens of Llama-3-8B KV) in 5.4 s: 0.5 GB/s, a slow link.
    bench = _compare_dir(tmp_path, 10, 5.36, 10 * 2048 * 131072)
    assert json.loads((bench / "compare.json").read_text())["rates"][0]["rate"] == "inf"
    assert main(["plan", "--profile", "llama3-8b-a100", "--rate", "2", "--slo", "ttft:600", "tpot:30",
                 "--bench", str(bench)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert f"from {bench}: bandwidth 5.008e+08, input_len 2048, output_len 64, prefill_ms 150" in text
    assert "target 2 req/s of 2048 prompt + 64 output tokens" in text
    assert "536.0 ms to move at 0.50 GB/s" in text  # the measured rate stands for NIXL's fixed cost too
    assert "plan: COLOCATE" in text


def test_plan_without_a_compare_result_says_which_file_it_wanted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*PLAN, "--bench", str(tmp_path)]) == 2
    assert f"cannot read {tmp_path / 'compare.json'}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench"], "needs a URL to measure, or --compare"),
        (["bench", "--compare", "http://127.0.0.1:21999"], "--compare starts its own instances"),
        (["bench", "--compare", "--sim-kv-gbps", "1"], "--sim-kv-gbps applies to --engine sim only"),
        (["bench", "http://127.0.0.1:21999", "--goodput", "ttft=5"], "--goodput takes KEY:MS"),
        (
            ["bench", "--compare", "--engine", "sim", "--colocated-port", "8100"],
            "collides with the topology's ports",
        ),
    ],
)
def test_bench_refuses_what_it_cannot_run_before_starting_anything(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--result-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


# The simulator with llama3-8b-a100's timing behind a 0.5 GB/s KV link: each 1,024-token prompt's KV
# (134 MB) takes ~270 ms of simulated transfer, so splitting costs more than it saves by a wide margin
# (TTFT ~4x colocated's). Ports of its own (21400-21499), away from test_bench_vllm's.
SIM_COMPARE = ["bench", "--compare", "--engine", "sim", "--sim-profile", "llama3-8b-a100", "--sim-kv-gbps", "0.5",
               "--num-prompts", "4", "--input-len", "1024", "--output-len", "8", "--request-rate", "8", "16",
               "--max-concurrency", "2", "--num-warmups", "0", "--goodput", "ttft:2000", "tpot:100",
               "--port", "21400", "--first-port", "21410", "--first-side-channel-port", "21450"]  # fmt: skip
_CELL = r"(-?[\d.]+|inf|nan)"


def _rows(text: str, rate: str) -> dict[str, tuple[float, ...]]:
    """Each row of the side-by-side table at ``rate``: (disaggregated, colocated[, d/c])."""
    table = text.split(f"rate {rate} req/s", 1)[1].split("\nrate ", 1)[0].split("\nverdict: ", 1)[0]
    found = re.findall(rf"^  (\S.*?\S) +{_CELL} +{_CELL}(?: +{_CELL})?$", table, re.M)
    return {name: tuple(float(v) for v in values if v) for name, *values in found}


@pytest.mark.vllm  # not an engine, but vLLM's own benchmark client, run from the engine venv
def test_compare_on_the_simulator_prints_both_modes_side_by_side_and_a_verdict_with_its_reasons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SIM_COMPARE, "--result-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for rate in ("8", "16"):
        assert f"disaggregated at {rate} req/s: 4 requests via http://127.0.0.1:21400" in text
        assert f"colocated at {rate} req/s: 4 requests via http://127.0.0.1:21401" in text
        rows = _rows(text, rate)
        assert {"TTFT p50 ms", "TPOT p50 ms", "ITL p90 ms", "E2EL p50 ms", "goodput req/s"} <= set(rows), text
        assert rows["failed"] == (0.0, 0.0), text  # no ratio printed for failures
        for name in ("TTFT p50 ms", "E2EL p50 ms", "goodput req/s"):
            d, c, ratio = rows[name]
            assert ratio == pytest.approx(d / c, abs=0.01), (name, text)
        # Every split request waits for its KV to cross the slow link; a whole one never does.
        assert rows["TTFT p50 ms"][2] > 2, text
    verdict = re.search(r"^verdict: COLOCATE: goodput disaggregated/colocated ([\d.]+)x \(summed over 2 rate\(s\)\)$",
                        text, re.M)  # fmt: skip
    assert verdict and float(verdict.group(1)) < 1, text
    transfer = re.search(r"^  - transfer: (\d+) KV transfers, 134\.22 MB each, [\d.]+ ms mean \(([\d.]+) GB/s\)",
                         text, re.M)  # fmt: skip
    assert transfer, text
    assert int(transfer.group(1)) == 2 * 4, text  # every split request moved its KV, once
    assert float(transfer.group(2)) == pytest.approx(0.5, abs=0.05), text  # the link it was given
    assert re.search(r"^  - queueing, disaggregated: @8: TTFT p50 [\d.]+ ms", text, re.M), text
    assert re.search(r"^  - interference: colocated ITL p90 [\d.]+x disaggregated", text, re.M), text
    # What it leaves for `pdserve plan --bench` and for people: the summary, the report, both plots.
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert summary["verdict"]["decision"] == "colocate"
    assert [r["rate"] for r in summary["rates"]] == ["8", "16"]
    assert (tmp_path / "report.txt").read_text().startswith("rate 8 req/s")
    for png in ("latency-cdf.png", "latency-vs-rate.png"):
        assert f"plot: {tmp_path / png}" in text
        assert png_size(tmp_path / png)[0] > 0
    # vLLM's client took the sim's tokenizer directory as it is (a config it cannot parse costs 2 s a run).
    assert "Error parsing config" not in (tmp_path / "vllm-bench.log").read_text()
