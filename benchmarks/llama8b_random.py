"""Build a Llama-3-8B-shaped model with random weights, for measuring vLLM where no model hub is reachable.

    python3 benchmarks/llama8b_random.py OUTDIR [--device cuda] [--small]

Shape: Meta-Llama-3-8B's (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256,
bf16: 8.03e9 parameters, 16.06 GB), so step times, KV bytes per token (128 KiB) and weight reads are the
real model's. The weights are random, so the text is gibberish, but deterministic: greedy output is an
equality oracle, as with pdserve's tiny model. ``--small`` keeps the vocabulary and shrinks the rest (a
quick check that vLLM loads what this writes, on a CPU too).

The tokenizer is byte-level BPE like Llama-3's, with a vocabulary of exactly 128,256: the 4 special tokens
of pdserve's tiny model, the 256 byte tokens, then merges of letters (pairs, triples, quadruples) up to the
size. The model's vocab_size equals the tokenizer's: a larger model vocabulary answers with ids the
tokenizer cannot print. Logits of special and unprintable tokens are zeroed (their lm_head rows), so
greedy output never ends early and every streamed token is readable text.

Weights are drawn on the GPU (``--device cuda``; seconds for 16 GB) and written as safetensors shards;
the script prints how long generation and writing took. Needs torch, tokenizers, transformers and
safetensors (the H200 image has them); imports pdserve only for the tiny model's chat template.
"""

from __future__ import annotations

import argparse
import itertools
import json
import string
import sys
import time
from pathlib import Path
from typing import Any

# mypy runs in the pdserve venv, which lacks these; "unused-ignore" keeps it clean where they exist.
import torch  # type: ignore[import-not-found,unused-ignore]
from safetensors.torch import save_file  # type: ignore[import-not-found,unused-ignore]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]

from pdserve.engines.tinymodel import SPECIAL_TOKENS, as_llama_tokenizer

SEED = 20251202
VOCAB_SIZE = 128256  # Llama-3's
SHAPE = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp": 14336}
SMALL = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 1, "head_dim": 64, "mlp": 512}
MAX_LEN = 8192  # Meta-Llama-3-8B's context
SHARD_BYTES = 4 << 30


def build_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = _bytes_to_unicode()  # the characters byte-level BPE maps bytes 0..255 to, in byte order
    assert set(byte_chars) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for char in byte_chars:  # byte b is token len(SPECIAL_TOKENS) + b
        vocab[char] = len(vocab)
    # Letters plus "Ġ" (a space in byte-level form), so merged tokens read as words and spaces.
    letters = [*string.ascii_lowercase, *string.ascii_uppercase[:13], "Ġ"]
    merges: list[tuple[str, str]] = []
    layer = letters
    while len(vocab) < VOCAB_SIZE:  # breadth first: a token's prefix is always a token already
        longer = []
        for prefix, last in itertools.product(layer, letters):
            if len(vocab) >= VOCAB_SIZE:
                break
            token = prefix + last
            vocab[token] = len(vocab)
            merges.append((prefix, last))
            longer.append(token)
        layer = longer
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return as_llama_tokenizer(tok, MAX_LEN)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte → character table, in byte order (tokenizers' ByteLevel uses the same one)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def banned_ids() -> list[int]:
    """Special tokens and byte tokens that are not printable ASCII (merges are letters and spaces)."""
    num_special = len(SPECIAL_TOKENS)
    return list(range(num_special)) + [num_special + b for b in range(256) if not 0x20 <= b <= 0x7E]


def weight_shapes(s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB_SIZE, h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (s["mlp"], h),
            p + "mlp.up_proj.weight": (s["mlp"], h),
            p + "mlp.down_proj.weight": (h, s["mlp"]),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (VOCAB_SIZE, h)}
    return shapes


def random_weight(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if "embed_tokens" in name:
        # Unit scale (not 0.02): tokens stay distinguishable after the norms, so greedy text wanders
        # over the vocabulary instead of repeating one token (as in the tiny model).
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    std = shape[-1] ** -0.5  # fan-in scaling: activations stay O(1) through 32 layers
    w = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(torch.bfloat16)
    if name == "lm_head.weight":
        w[banned_ids()] = 0  # zero logits: the max over 128k random logits is always above zero
    return w


def build(outdir: Path, device: str, small: bool) -> dict[str, Any]:
    shape = SMALL if small else SHAPE
    outdir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, Any] = {"shape": shape, "vocab_size": VOCAB_SIZE}
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    tokenizer.save_pretrained(outdir)
    timings["tokenizer_s"] = round(time.perf_counter() - started, 2)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape["hidden"],
        intermediate_size=shape["mlp"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    config.save_pretrained(outdir)
    (outdir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}) + "\n"
    )
    gen = torch.Generator(device=device).manual_seed(SEED)
    shapes = weight_shapes(shape)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0
    gen_s = write_s = 0.0
    names = list(shapes)
    num_shards = 0

    def flush() -> None:
        nonlocal shard, shard_bytes, num_shards, write_s
        num_shards += 1
        begun = time.perf_counter()
        save_file(shard, str(outdir / f"model-{num_shards:05d}.safetensors"), metadata={"format": "pt"})
        write_s += time.perf_counter() - begun
        shard, shard_bytes = {}, 0

    for name in names:
        begun = time.perf_counter()
        tensor = random_weight(name, shapes[name], gen, device).cpu()
        gen_s += time.perf_counter() - begun
        if shard and shard_bytes + tensor.nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor
        weight_map[name] = f"model-{num_shards + 1:05d}.safetensors"
        shard_bytes += tensor.nbytes
        total_bytes += tensor.nbytes
    flush()
    # Shard names carry no "-of-N" suffix, so the index can be written once the count is known.
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (outdir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    meta = {"name": "llama3-8b-random", "seed": SEED, "dtype": "bfloat16", "small": small}
    (outdir / "pdserve_model.json").write_text(json.dumps(meta) + "\n")
    timings |= {
        "bytes": total_bytes,
        "shards": num_shards,
        "generate_and_copy_s": round(gen_s, 2),
        "write_s": round(write_s, 2),
        "write_gb_per_s": round(total_bytes / write_s / 1e9, 2) if write_s else None,
        "total_s": round(time.perf_counter() - started, 2),
    }
    return timings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="same vocabulary, tiny layers (a quick check)")
    a = p.parse_args(argv)
    timings = build(a.outdir.resolve(), a.device, a.small)
    print("RESULT " + json.dumps(timings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
