"""find_engine_python: which python runs vLLM, and a useful error when there is none."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.engines import venv
from pdserve.engines.venv import ENGINE_PYTHON_ENV, find_engine_python
from pdserve.errors import ConfigError

real_repo_root = venv._repo_root


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture(autouse=True)
def no_discovery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_PYTHON_ENV, raising=False)
    monkeypatch.setattr(venv, "_repo_root", lambda: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)


def test_explicit_path_wins_over_the_environment(fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_PYTHON_ENV, "/nonexistent/python")
    assert find_engine_python(fake_python) == fake_python


def test_environment_variable_is_used(fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_PYTHON_ENV, fake_python)
    assert find_engine_python() == fake_python


def test_repo_engine_venv_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / ".venv-engine" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    monkeypatch.setattr(venv, "_repo_root", lambda: tmp_path)
    assert find_engine_python() == str(python)  # the venv path, not the symlink's target


def test_broken_repo_engine_venv_says_to_rebuild_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / ".venv-engine" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(tmp_path / "gone")
    monkeypatch.setattr(venv, "_repo_root", lambda: tmp_path)
    with pytest.raises(ConfigError, match="make engine-venv"):
        find_engine_python()


def test_this_python_is_used_when_it_has_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    assert find_engine_python() == sys.executable


def test_no_engine_python_explains_how_to_get_one() -> None:
    with pytest.raises(ConfigError, match=r"make engine-venv.*--engine-python"):
        find_engine_python()


def test_missing_or_non_executable_explicit_path_is_a_config_error(fake_python: str) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        find_engine_python("/nonexistent/python")
    Path(fake_python).chmod(0o644)
    with pytest.raises(ConfigError, match="not executable"):
        find_engine_python(fake_python)


def test_repo_root_is_this_checkout() -> None:
    root = real_repo_root()
    assert root is not None and (root / "src" / "pdserve" / "engines" / "venv.py").is_file()


# --- the engine's vLLM version ------------------------------------------------------------------------


def fake_vllm(root: Path, version: str) -> None:
    package = root / "vllm"
    package.mkdir(parents=True)
    # Importing the package would fail: the probe must read _version.py alone (no torch import).
    (package / "__init__.py").write_text("raise RuntimeError('vllm imported')\n")
    (package / "_version.py").write_text(f"__version__ = version = {version!r}\n")


def test_the_version_is_read_without_importing_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(tmp_path, "0.26.0")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert venv.engine_vllm_version(sys.executable) == "0.26.0"


def test_no_vllm_or_no_python_gives_no_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # an empty dir: nothing named vllm there
    assert venv.engine_vllm_version(str(tmp_path / "missing-python")) is None


@pytest.mark.parametrize("version", ["0.26.0", "0.26.3", "0.32.0", "0.32.1+cpu"])
def test_tested_versions_get_no_warning(version: str) -> None:
    assert venv.version_warning(version, "/venv/bin/python") is None


@pytest.mark.parametrize("version", ["0.25.1", "0.30.0", "0.33.0", "1.0.0", "dev"])
def test_other_versions_are_warned_about_naming_the_tested_ones(version: str) -> None:
    warning = venv.version_warning(version, "/venv/bin/python")
    assert warning is not None
    assert (
        f"vLLM {version} (/venv/bin/python) is not a version pdserve is tested with (0.26.x, 0.32.x)"
        in warning
    )


def test_an_unknown_version_is_warned_about_too() -> None:
    warning = venv.version_warning(None, "/venv/bin/python")
    assert warning is not None and "could not learn the vLLM version of /venv/bin/python" in warning
