"""Fixtures shared by the engines tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def engine_python() -> str:
    """The engine venv's python (torch, transformers, vLLM, NIXL): `make test` sets PDSERVE_ENGINE_PYTHON."""
    value = os.environ.get("PDSERVE_ENGINE_PYTHON")
    if not value:
        pytest.fail(
            "PDSERVE_ENGINE_PYTHON is not set: point it at the engine venv's python "
            "(the one with torch/transformers/vllm), e.g. PDSERVE_ENGINE_PYTHON=/tmp/probe/venv/bin/python",
            pytrace=False,
        )
    return value
