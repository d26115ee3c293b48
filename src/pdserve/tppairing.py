"""Which prefill and decode tensor-parallel sizes vLLM's NixlConnector can pair, and how decode's ranks then
read prefill's: the rules `pdserve up` checks at start-up, the simulator's decodes obey, and the doctor states.

Pure: no torch, no vLLM. Read in vLLM 0.32's installed source, pull mode (decode READs prefill's KV over
NIXL, so decode is vLLM's "local" side and prefill its "remote"; docs/vllm.md, "Heterogeneous tensor
parallelism"). vLLM checks these at decode's NIXL handshake with a prefill, the first time a request names
it; a refused pair fails every request that pulls from it (kv_load_failure_policy "fail", the default),
long after both instances started healthy. Here they fail at start-up instead, or in the simulator the
way vLLM's request fails.

A fact this module is not given (``None``) makes the rules that need it pass: vLLM has the last word at
the handshake, so an unknown is never a refusal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pdserve.errors import ConfigError

TP_FLAGS: Final = ("--tensor-parallel-size", "-tp")  # vLLM's flag and its alias (engine/arg_utils.py)
BLOCK_SIZE_FLAG: Final = "--block-size"

# Where config.json keeps the KV-head count, in the order vLLM looks (transformers_utils/
# model_arch_config_convertor.py, get_total_num_kv_heads); none of them: as many as attention heads.
_KV_HEAD_KEYS: Final = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                        "num_attention_groups")  # fmt: skip
# Signs of layers that are not attention (Mamba, SSM, linear attention) in a config.json.
_HYBRID_SIGN: Final = re.compile(r"mamba|ssm|linear_att|short_conv")


@dataclass(frozen=True)
class KVShape:
    """What the pairing rules read of the model: its KV heads, and whether it is MLA or a hybrid."""

    num_kv_heads: int | None = None  # total KV heads (config.json num_key_value_heads); None: unknown
    is_mla: bool = False  # latent attention (DeepSeek-style): every rank holds the whole cache
    is_hybrid: bool = False  # Mamba/SSM layers beside attention: vLLM pairs their KV by other rules


UNKNOWN_SHAPE: Final = KVShape()  # a model of which nothing is known: only the rules for every model apply


def kv_shape_from_config(config: Mapping[str, Any]) -> KVShape:
    """A model's ``KVShape`` from its config.json (the text model's, for a multimodal one).

    MLA and hybrid are told from the config's keys: a guess that errs towards both, whose rules refuse
    less (MLA: ``kv_lora_rank``, the latent width every MLA family vLLM knows sets; hybrid: keys or layer
    types naming Mamba, SSM or linear attention)."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = text
    heads = next((config[k] for k in _KV_HEAD_KEYS if config.get(k) is not None), None)
    if heads is None:
        heads = config.get("num_attention_heads")
    is_hybrid = any(_HYBRID_SIGN.search(str(k)) for k in config) or any(
        _HYBRID_SIGN.search(str(t)) for t in config.get("layer_types") or ()
    )
    return KVShape(
        num_kv_heads=heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None,
        is_mla=config.get("kv_lora_rank") is not None,
        is_hybrid=is_hybrid,
    )


@dataclass(frozen=True)
class TPPairing:
    """A pair vLLM supports, and how decode's ranks read prefill's."""

    prefill_tp: int
    decode_tp: int
    # vLLM's (TransferTopology.tp_ratio): decode/prefill when decode's TP is the larger or equal, each
    # prefill rank then read by that many decode ranks; -(prefill/decode) when prefill's is larger, each
    # decode rank then reading that many prefill ranks.
    tp_ratio: int
    mapping: str  # how, in words

    def describe(self) -> str:
        return f"prefill TP{self.prefill_tp} → decode TP{self.decode_tp}: {self.mapping}"


def pair_tp(
    prefill_tp: int,
    decode_tp: int,
    shape: KVShape = UNKNOWN_SHAPE,
    *,
    prefill_block_size: int | None = None,
    decode_block_size: int | None = None,
) -> TPPairing:
    """The mapping vLLM's NixlConnector (pull) uses when a decode of ``decode_tp`` ranks reads a prefill
    of ``prefill_tp``, or ConfigError naming what vLLM does not support. Block sizes are the instances'
    ``--block-size`` (None: unknown)."""
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"{role} tensor-parallel size must be a whole number >= 1, got {tp!r}")
    p, d = prefill_tp, decode_tp
    pair = f"prefill TP{p} and decode TP{d}"
    # kv_connector/utils.py TransferTopology.tp_ratio asserts that the larger size is a multiple of the
    # smaller; decode computes it at the handshake (handshake_target_ranks), so the handshake fails.
    if max(p, d) % min(p, d):
        raise ConfigError(
            f"{pair} cannot pair: vLLM's NixlConnector needs one tensor-parallel size to be a multiple "
            f"of the other (decode ranks read whole prefill ranks)"
        )
    heads = shape.num_kv_heads
    splits_heads = not shape.is_mla and not shape.is_hybrid
    # nixl/base_worker.py _validate_remote_agent_handshake: `assert not (tp_ratio < 0 and
    # is_kv_replicated(remote))` for models neither MLA nor hybrid. Prefill ranks beyond the KV heads hold
    # replicated heads, and vLLM reads no replicated KV into fewer decode ranks.
    if splits_heads and heads is not None and p > d and p > heads:
        raise ConfigError(
            f"{pair} cannot pair: with more prefill ranks than the model's {heads} KV heads each prefill "
            f"rank holds a replicated head, and vLLM's NixlConnector does not read replicated KV into a "
            f"smaller decode TP; give decode TP >= {p}, or prefill TP <= {heads}"
        )
    _check_block_sizes(pair, p, d, heads, splits_heads, prefill_block_size, decode_block_size)
    if p == d:
        return TPPairing(p, d, 1, "same TP: decode rank i reads prefill rank i (tp_ratio 1)")
    if d > p:
        ratio = d // p
        if shape.is_mla:
            how = f"{ratio} decode ranks read each prefill rank's whole MLA cache, which every rank holds"
        elif heads is None:
            how = f"{ratio} decode ranks share each prefill rank, each reading its part of the KV heads"
        else:
            p_heads, d_heads = max(1, heads // p), max(1, heads // d)
            how = (f"{ratio} decode ranks share each prefill rank, each reading {d_heads} of its "
                   f"{p_heads} KV head{'s' if p_heads > 1 else ''}")  # fmt: skip
            if d > heads:
                how += f"; decode TP{d} > {heads} KV heads, so decode ranks hold replicated heads"
        return TPPairing(p, d, ratio, f"{how} (tp_ratio {ratio})")
    ratio = p // d
    if shape.is_mla:
        how = f"each decode rank reads one of {ratio} prefill ranks, all holding the same MLA cache"
    elif heads is None or not splits_heads:
        how = f"each decode rank reads the KV heads of {ratio} prefill ranks"
    else:
        how = f"each decode rank reads the KV heads of {ratio} prefill ranks, {heads // p} from each"
    return TPPairing(p, d, -ratio, f"{how} (tp_ratio -{ratio})")


def _check_block_sizes(
    pair: str, p: int, d: int, heads: int | None, splits_heads: bool, p_block: int | None, d_block: int | None
) -> None:
    """vLLM compares the attention kernel's block sizes, which are the ``--block-size`` values whenever the
    attention backend takes that size (FlashAttention: any multiple of 16)."""
    if p_block is None or d_block is None:
        return
    # kv_connector/utils.py TransferTopology.block_size_ratio asserts decode's block size is a multiple of
    # prefill's (one decode block holds whole prefill blocks; post_process_device_kv_on_receive: "Only
    # nP < nD supported").
    if d_block % p_block:
        raise ConfigError(
            f"{pair} cannot pair: decode --block-size {d_block} is not a multiple of prefill's {p_block}, "
            f"which vLLM's NixlConnector needs"
        )
    # _validate_remote_agent_handshake, a prefill TP larger than decode's on KV split by heads:
    # "Different local/remote block sizes are not supported when P TP > D TP".
    is_replicated = heads is not None and p > heads
    if p > d and splits_heads and not is_replicated and p_block != d_block:
        raise ConfigError(
            f"{pair} cannot pair: with a larger prefill TP vLLM's NixlConnector needs equal block sizes, "
            f"got prefill --block-size {p_block}, decode {d_block}"
        )


def flag_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value the last of ``names`` is given in ``args`` (``--flag V`` or ``--flag=V``), as argparse
    takes the last one; None if none is there. Any vLLM flag (the demo reads ``--dtype`` with it)."""
    value: str | None = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in names:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def tensor_parallel_size(args: Sequence[str], default: int = 1) -> int:
    """The ``--tensor-parallel-size`` (``-tp``) that vLLM arguments ``args`` set, else ``default`` (vLLM's 1)."""
    value = _whole(args, TP_FLAGS)
    return default if value is None else value


def block_size(args: Sequence[str]) -> int | None:
    """The ``--block-size`` that vLLM arguments ``args`` set, else None (the platform's default)."""
    return _whole(args, (BLOCK_SIZE_FLAG,))


def _whole(args: Sequence[str], names: Sequence[str]) -> int | None:
    value = flag_value(args, names)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{names[0]} must be a whole number >= 1, got {value!r}")
    return int(value)
