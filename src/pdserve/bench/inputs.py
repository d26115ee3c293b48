"""Local inputs for vLLM's benchmark client: a ShareGPT-format sample, and a tokenizer for the simulator.

Nothing is downloaded. ``write_sharegpt_sample`` writes conversations in ShareGPT's JSON shape
(``[{"conversations": [{"from": "human", "value": …}, {"from": "gpt", "value": …}]}, …]``, what vLLM's
``--dataset-name sharegpt`` reads) with long-tailed lengths like ShareGPT's (log-normal, medians of ~120
prompt and ~150 answer words, capped so a prompt stays under vLLM's 1,024-token filter even on a
tokenizer that splits each word in four).

vLLM's client counts prompt tokens with a Hugging Face tokenizer, and the simulator counts one token per
word (sim/tokenizer.py). ``write_sim_tokenizer`` writes a word-level tokenizer whose every token is one
such word, so a "512-token" random prompt is 512 tokens to both.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Final

from tokenizers import Tokenizer, models, pre_tokenizers

_CONSONANTS: Final = "bdfgklmnprstvz"
_VOWELS: Final = "aeiou"
_NUM_WORDS: Final = 32768  # random prompts rarely repeat: vLLM's generator walks the vocabulary in order


def words(count: int = _NUM_WORDS) -> list[str]:
    """``count`` distinct three-syllable words (bakedi, bakedo, …), the same on every call."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    return ["".join(s) for s in itertools.islice(itertools.product(syllables, repeat=3), count)]


def write_sim_tokenizer(directory: Path) -> Path:
    """A Hugging Face tokenizer directory (``tokenizer.json`` + config) with one token per word."""
    vocab = {w: i for i, w in enumerate(words())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=next(iter(vocab))))
    # Whitespace splits like the sim's \w+ pattern; no special tokens, so vLLM's client samples them all.
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    # vLLM's client reads the directory's model config before the tokenizer; without one it fails, waits
    # 2 s and retries (transformers_utils/repo_utils.with_retry): 2 s of every run. Any known model_type
    # will do: the tokenizer class comes from tokenizer_config.json either way.
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def _length(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(0.0, sigma) * median)))


def sharegpt_sample(num: int, seed: int = 0) -> list[dict[str, object]]:
    """``num`` ShareGPT-shaped conversations of one human turn and one answer."""
    rng = random.Random(seed)
    vocab = words(4096)
    entries: list[dict[str, object]] = []
    for i in range(num):
        prompt = " ".join(rng.choices(vocab, k=_length(rng, 120, 0.9, 8, 250)))
        answer = " ".join(rng.choices(vocab, k=_length(rng, 150, 0.7, 8, 250)))
        entries.append({
            "id": f"pdserve-{seed}-{i}",
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
        })  # fmt: skip
    return entries


def write_sharegpt_sample(path: Path, num: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sharegpt_sample(num, seed)))
    return path
