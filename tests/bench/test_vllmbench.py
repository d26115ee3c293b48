"""vLLM's benchmark client process, where it cannot work: the error says why and shows its log.

(The working path, `vllm bench serve` runs against real endpoints, is tests/e2e/test_bench_vllm.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.bench.vllmbench import BenchClient
from pdserve.errors import BenchError


def test_a_python_without_vllm_is_a_clear_error_with_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "vllm-bench.log"
    refused = pytest.raises(BenchError, match="cannot import vLLM's benchmark client")
    with BenchClient(sys.executable, log) as client, refused as caught:  # pdserve's own venv: no vLLM
        client.run(["--help"], timeout=60)
    assert f"last lines of {log}" in str(caught.value)
    assert "ModuleNotFoundError" in log.read_text()


def test_a_python_that_does_not_exist_is_a_bench_error_too(tmp_path: Path) -> None:
    client = BenchClient(str(tmp_path / "no-python"), tmp_path / "vllm-bench.log")
    with pytest.raises(BenchError, match=r"cannot start vLLM's benchmark client with .*no-python"):
        client.run(["--help"], timeout=10)
    client.close()
