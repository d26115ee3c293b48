"""Find the python interpreter of the venv that has vLLM installed.

vLLM lives in its own venv (it pins transformers, fastapi, starlette… that the proxy should not inherit),
so pdserve starts instances with that venv's python rather than its own.
"""

from __future__ import annotations

import importlib.util
import os
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
