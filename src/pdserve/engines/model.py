"""Which model the engines serve: the embedded tiny model (built on first use), a local dir, or a hub name.

The embedded model is built by ``tinymodel.py`` running under the *engine* venv's python, because torch
lives only there; this module only runs that script and never imports torch.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import ModelBuildError

EMBEDDED_MODEL_NAME = "pdserve-tiny"  # served model name of the embedded model
EMBEDDED_MODEL_VERSION = "v1"  # bump when tinymodel.py changes output: a new dir, never a stale cache

TINYMODEL_SCRIPT = Path(__file__).with_name("tinymodel.py")
BUILD_TIMEOUT_S = 300.0  # a build takes ~6 s; torch import on a loaded CI box can be far slower
_STDERR_TAIL_CHARS = 4000


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR`` if set and non-empty, else ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pdserve"


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """``<cache>/models/pdserve-tiny-v1``: the version in the name keeps old builds from being reused."""
    base = cache_dir if cache_dir is not None else default_cache_dir()
    return base / "models" / f"{EMBEDDED_MODEL_NAME}-{EMBEDDED_MODEL_VERSION}"


def _is_built(model_dir: Path) -> bool:
    # tinymodel.py renames a complete temp dir into place, so config.json present means fully built.
    return (model_dir / "config.json").is_file()


def _tail(text: str) -> str:
    text = text.strip()
    return text[-_STDERR_TAIL_CHARS:] if text else "(no output)"


def ensure_embedded_model(engine_python: str, cache_dir: Path | None = None) -> Path:
    """Return the embedded model dir, building it first with ``engine_python tinymodel.py DIR`` if needed.

    Concurrent callers (several launchers, parallel tests) serialise on ``<cache>/models/.lock``; the
    first builds, the rest find it built. Raises ModelBuildError with the script's stderr tail on failure.
    """
    model_dir = embedded_model_dir(cache_dir)
    if _is_built(model_dir):
        return model_dir
    models_dir = model_dir.parent
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(models_dir / ".lock", "a+b")  # noqa: SIM115 - held across the build below
    except OSError as exc:
        raise ModelBuildError(f"cannot create model cache {models_dir}: {exc}") from exc
    with lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        if _is_built(model_dir):  # another process built it while we waited for the lock
            return model_dir
        cmd = [engine_python, str(TINYMODEL_SCRIPT), str(model_dir)]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
        except FileNotFoundError as exc:
            raise ModelBuildError(f"engine python {engine_python!r} not found: {exc}") from exc
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            raise ModelBuildError(
                f"building the embedded model timed out after {BUILD_TIMEOUT_S:.0f} s: {' '.join(cmd)}\n"
                f"{_tail(err)}"
            ) from exc
        except OSError as exc:
            raise ModelBuildError(f"cannot run {' '.join(cmd)}: {exc}") from exc
        if proc.returncode != 0:
            raise ModelBuildError(
                f"building the embedded model failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                f"{_tail(proc.stderr)}"
            )
        if not _is_built(model_dir):
            raise ModelBuildError(f"{TINYMODEL_SCRIPT.name} exited 0 but {model_dir}/config.json is missing")
    return model_dir


@dataclass(frozen=True)
class ResolvedModel:
    """What to pass to vLLM: ``--model path`` and, if not None, ``--served-model-name``."""

    path: str
    served_model_name: str | None
    is_embedded: bool


def resolve_model(model: str | None, engine_python: str, cache_dir: Path | None = None) -> ResolvedModel:
    """None -> the embedded model (built on first use, served as "pdserve-tiny"); an existing local
    directory -> that directory, absolute (vLLM names it by its path); anything else -> a hub name, passed
    through unchanged for vLLM to resolve (this machine has no hub, so that fails in vLLM, not here)."""
    if model is None:
        path = ensure_embedded_model(engine_python, cache_dir)
        return ResolvedModel(path=str(path), served_model_name=EMBEDDED_MODEL_NAME, is_embedded=True)
    local = Path(model).expanduser()
    if local.is_dir():
        return ResolvedModel(path=str(local.resolve()), served_model_name=None, is_embedded=False)
    return ResolvedModel(path=model, served_model_name=None, is_embedded=False)
