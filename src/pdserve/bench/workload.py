"""What `pdserve bench` sends, as vLLM's benchmark client takes it: datasets, load, SLOs → its arguments.

Pure: a ``Workload`` and a run's particulars become the argument list of one ``vllm bench serve`` run
(bench/vllmbench.py runs it). Every run asks for the detailed result JSON (each request's TTFT and
ITLs, for the CDF plots), vLLM's percentiles 50/90/99 of TTFT, TPOT, ITL and E2EL, greedy sampling and
``ignore_eos`` (a run's output length is the workload's, whatever the model says), and a ``cache_salt``
of its own (no '@' or '/': vLLM refuses those): vLLM then never serves one run's prompts from another run's prefix cache, so the second of
two runs on the same instances is not flattered by the first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Final, Literal

from pdserve.errors import ConfigError
from pdserve.slo import Slo

Dataset = Literal["random", "prefix", "sharegpt"]
DATASETS: Final[tuple[Dataset, ...]] = ("random", "prefix", "sharegpt")
PERCENTILES: Final = (50, 90, 99)


@dataclass(frozen=True)
class Workload:
    dataset: Dataset = "random"
    num_prompts: int = 100  # per run (one mode at one rate)
    input_len: int = 512  # prompt tokens (random, prefix: prefix + suffix)
    output_len: int = 128  # tokens generated per request (ShareGPT: None in the file's own lengths)
    prefix_len: int = 256  # prefix: tokens each group of prompts shares
    num_prefixes: int = 4  # prefix: how many distinct shared prefixes
    dataset_path: str | None = None  # sharegpt: a ShareGPT-format JSON file; None: a generated sample
    sharegpt_output_len: int | None = None  # sharegpt: None keeps each conversation's answer length
    request_rates: tuple[float, ...] = (math.inf,)  # requests/s (Poisson); inf: all at once
    max_concurrency: int | None = None  # requests in flight at most (vLLM's --max-concurrency)
    slo: Slo = field(default_factory=Slo)
    num_warmups: int = 2  # requests before each run's measurement starts
    seed: int = 0
    endpoint: str = "/v1/completions"

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"bench dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        for name in ("num_prompts", "input_len", "output_len", "num_prefixes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench {name} must be >= 1, got {getattr(self, name)}")
        if self.dataset == "prefix":
            if not 0 < self.prefix_len < self.input_len:
                raise ConfigError(
                    f"bench prefix_len must be in (0, input_len={self.input_len}), got {self.prefix_len}"
                )
            if self.num_prefixes > self.num_prompts:
                raise ConfigError("bench num_prefixes must not exceed num_prompts (vLLM's client refuses it)")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ConfigError(f"bench request rates must be > 0 (inf: all at once), got {self.request_rates}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"bench max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ConfigError("bench num_warmups must be >= 0")

    def describe(self) -> str:
        if self.dataset == "random":
            shape = f"random prompts of {self.input_len} tokens, {self.output_len} out"
        elif self.dataset == "prefix":
            shape = (f"{self.num_prefixes} shared {self.prefix_len}-token prefixes + "
                     f"{self.input_len - self.prefix_len} unique tokens, {self.output_len} out")  # fmt: skip
        else:
            shape = f"ShareGPT conversations from {self.dataset_path or 'a generated sample'}"
        load = f"concurrency ≤ {self.max_concurrency}" if self.max_concurrency else "no concurrency cap"
        return f"{self.num_prompts} requests per run: {shape}; {load}; SLOs {self.slo.describe()}"


def rate_arg(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def client_args(
    workload: Workload,
    base_url: str,
    rate: float,
    result_dir: str,
    result_name: str,
    *,
    seed: int,
    salt: str,
    tokenizer: str | None = None,
    dataset_path: str | None = None,
    label: str | None = None,
) -> list[str]:
    """The arguments of one ``vllm bench serve`` run of ``workload`` at ``rate`` against ``base_url``."""
    w = workload
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", w.endpoint]
    if w.dataset == "random":
        args += ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                 "--random-output-len", str(w.output_len)]  # fmt: skip
    elif w.dataset == "prefix":
        args += ["--dataset-name", "prefix_repetition",
                 "--prefix-repetition-prefix-len", str(w.prefix_len),
                 "--prefix-repetition-suffix-len", str(w.input_len - w.prefix_len),
                 "--prefix-repetition-num-prefixes", str(w.num_prefixes),
                 "--prefix-repetition-output-len", str(w.output_len)]  # fmt: skip
    else:
        path = dataset_path or w.dataset_path
        if path is None:
            raise ConfigError("the sharegpt dataset needs a file (generate one with bench/inputs.py)")
        args += ["--dataset-name", "sharegpt", "--dataset-path", path]
        if w.sharegpt_output_len is not None:
            args += ["--sharegpt-output-len", str(w.sharegpt_output_len)]
    args += ["--num-prompts", str(w.num_prompts), "--request-rate", rate_arg(rate), "--seed", str(seed)]
    if w.max_concurrency is not None:
        args += ["--max-concurrency", str(w.max_concurrency)]
    args += ["--temperature", "0", "--ignore-eos", "--num-warmups", str(w.num_warmups)]
    args += [
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        ",".join(map(str, PERCENTILES)),
    ]
    args += w.slo.goodput_args()
    args += ["--extra-body", json.dumps({"cache_salt": salt})]
    args += ["--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", result_name]
    args += ["--disable-tqdm"]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    if label:
        args += ["--label", label]
    return args
