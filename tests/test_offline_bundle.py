"""scripts/offline-bundle.sh on a tiny fake wheel set: what a user carries to a GPU host without network
comes back whole there, stripped of what vLLM never loads, however it was split and staged."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "offline-bundle.sh"


def _wheel(dir: Path, name: str, files: dict[str, bytes]) -> None:
    """A minimal pure-Python wheel holding ``files``."""
    info = f"{name}-1.0.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    entries = {**files, **meta}
    record = "".join(f"{path},,\n" for path in entries) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(dir / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        for path, data in {**entries, f"{info}/RECORD": record.encode()}.items():
            whl.writestr(path, data)


def _run(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], env=env, capture_output=True, text=True,
                          check=check, timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle of two fake wheels, in parts of 16 KiB (the payload does not compress: several parts)."""
    root = tmp_path_factory.mktemp("offline")
    wheels = root / "wheels"
    wheels.mkdir()
    _wheel(wheels, "vllm", {
        "vllm/__init__.py": b"__version__ = 'fake'\n",
        "vllm/payload.bin": os.urandom(40_000),
        "vllm/vllm-rs": b"a frontend vLLM never loads for a dense model\n",
        "vllm/_moe_C_stable_libtorch.abi3.so": b"MoE kernels\n",
    })  # fmt: skip
    _wheel(wheels, "nixl", {"nixl/__init__.py": b"", "nixl/_api.py": b"OK = True\n"})
    out = root / "bundle"
    _run("build", "--wheels-from", wheels, "--out", out, "--part-size", "16K", "--level", "0")
    return out


def test_build_splits_the_archive_into_parts_of_at_most_the_size_asked(bundle: Path) -> None:
    parts = sorted(bundle.glob("site.tar.xz.part-*"))
    assert len(parts) >= 3 and all(p.stat().st_size <= 16 * 1024 for p in parts)
    manifest = (bundle / "bundle.manifest").read_text()
    assert f"parts {len(parts)}\n" in manifest and "sha256 " in manifest
    assert (bundle / "offline-bundle.sh").read_bytes() == SCRIPT.read_bytes()  # the host needs no clone


def test_install_joins_unpacks_strips_and_prints_the_env(bundle: Path, tmp_path: Path) -> None:
    done = _run("install", "--from", bundle, "--to", tmp_path)
    site = tmp_path / "site"
    assert (site / "vllm" / "payload.bin").stat().st_size == 40_000
    assert (site / "nixl" / "_api.py").read_text() == "OK = True\n"
    assert (
        not (site / "vllm" / "vllm-rs").exists()
        and not (site / "vllm" / "_moe_C_stable_libtorch.abi3.so").exists()
    )
    assert f"export PYTHONPATH={site}" in done.stdout and "VLLM_USE_FLASHINFER_SAMPLER=0" in done.stdout
    assert (tmp_path / "env.sh").read_text() == done.stdout
    probe = f'{done.stdout}\n"$PYTHON" -c "import nixl._api as a; print(a.OK)"'
    env = {**os.environ, "PYTHON": sys.executable}
    assert subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True).stdout == "True\n"
    again = _run("install", "--from", bundle, "--to", tmp_path)
    assert "not unpacking again" in again.stderr and again.stdout == done.stdout


def test_parts_staged_as_they_arrive_join_with_the_last_ones(bundle: Path, tmp_path: Path) -> None:
    first, *rest = sorted(bundle.glob("site.tar.xz.part-*"))
    last = tmp_path / "last"
    last.mkdir()
    for part in rest:
        (last / part.name).write_bytes(part.read_bytes())
    (last / "bundle.manifest").write_bytes((bundle / "bundle.manifest").read_bytes())
    to = tmp_path / "host"
    missing = _run("install", "--from", last, "--to", to, check=False)
    assert missing.returncode == 3 and first.name in missing.stderr
    _run("stage", "--to", to, first)
    _run("install", "--from", last, "--to", to)
    assert (to / "site" / "vllm" / "payload.bin").stat().st_size == 40_000


def test_a_damaged_part_is_refused(bundle: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in bundle.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    part = damaged / "site.tar.xz.part-001"
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    refused = _run("install", "--from", damaged, "--to", tmp_path / "host", check=False)
    assert refused.returncode == 4 and "do not match" in refused.stderr
    assert not (tmp_path / "host" / "site").exists()


def test_without_a_part_size_the_bundle_is_one_part(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "nixl", {"nixl/__init__.py": b""})
    _run("build", "--wheels-from", wheels, "--out", tmp_path / "one", "--level", "0", "--no-strip")
    assert [p.name for p in (tmp_path / "one").glob("site.tar.xz.part-*")] == ["site.tar.xz.part-000"]
    _run("install", "--from", tmp_path / "one", "--to", tmp_path / "host")
    assert (tmp_path / "host" / "site" / "nixl" / "__init__.py").exists()
