"""vLLM's tensor-parallel pairing rules for PD: which prefill TP / decode TP pairs a user may start, how
decode's ranks then read prefill's, and what the refusal tells them."""

from __future__ import annotations

import pytest

from pdserve.errors import ConfigError
from pdserve.tppairing import (
    KVShape,
    block_size,
    kv_shape_from_config,
    pair_tp,
    tensor_parallel_size,
)

LLAMA_8B = KVShape(num_kv_heads=8)  # Meta-Llama-3-8B / 70B: 8 KV heads
SMOLLM = KVShape(num_kv_heads=3)  # SmolLM2-135M, pdserve's default model
DEEPSEEK = KVShape(num_kv_heads=128, is_mla=True)


def test_same_tp_reads_rank_for_rank() -> None:
    pairing = pair_tp(2, 2, LLAMA_8B)
    assert pairing.tp_ratio == 1
    assert "decode rank i reads prefill rank i" in pairing.describe()


def test_a_larger_decode_tp_splits_each_prefill_ranks_kv_heads() -> None:
    pairing = pair_tp(2, 4, LLAMA_8B)
    assert pairing.tp_ratio == 2
    assert pairing.describe() == (
        "prefill TP2 → decode TP4: 2 decode ranks share each prefill rank, each reading 2 of its 4 KV heads "
        "(tp_ratio 2)"
    )


def test_a_decode_tp_beyond_the_kv_heads_is_supported_with_replicated_heads() -> None:
    pairing = pair_tp(2, 16, LLAMA_8B)
    assert pairing.tp_ratio == 8
    assert "each reading 1 of its 4 KV heads" in pairing.mapping
    assert "replicated" in pairing.mapping


def test_a_smaller_decode_tp_reads_several_prefill_ranks() -> None:
    pairing = pair_tp(4, 2, LLAMA_8B)
    assert pairing.tp_ratio == -2
    assert "each decode rank reads the KV heads of 2 prefill ranks, 2 from each" in pairing.mapping


@pytest.mark.parametrize(("prefill", "decode"), [(2, 3), (3, 2), (4, 6), (6, 4)])
def test_sizes_that_do_not_divide_one_another_are_refused_for_every_model(prefill: int, decode: int) -> None:
    for shape in (KVShape(), LLAMA_8B, DEEPSEEK):
        with pytest.raises(ConfigError, match="one tensor-parallel size to be a multiple of the other"):
            pair_tp(prefill, decode, shape)


def test_replicated_prefill_kv_into_a_smaller_decode_is_refused_naming_the_heads() -> None:
    # SmolLM2's 3 KV heads: prefill TP 6 replicates them, and vLLM reads no replicated KV into TP 2 or 3.
    with pytest.raises(ConfigError, match="model's 3 KV heads") as refused:
        pair_tp(6, 2, SMOLLM)
    assert "give decode TP >= 6, or prefill TP <= 3" in str(refused.value)
    assert pair_tp(2, 6, SMOLLM).tp_ratio == 3  # the other way round is fine


def test_mla_pairs_any_sizes_that_divide_since_every_rank_holds_the_whole_cache() -> None:
    assert pair_tp(8, 1, DEEPSEEK).tp_ratio == -8
    assert "same MLA cache" in pair_tp(8, 2, DEEPSEEK).mapping
    assert "whole MLA cache" in pair_tp(1, 8, DEEPSEEK).mapping


def test_a_hybrid_model_may_read_replicated_kv_into_a_smaller_decode() -> None:
    assert pair_tp(4, 2, KVShape(num_kv_heads=2, is_hybrid=True)).tp_ratio == -2


def test_unknown_kv_heads_refuse_nothing_that_depends_on_them() -> None:
    assert pair_tp(8, 1).tp_ratio == -8
    assert "its part of the KV heads" in pair_tp(1, 4).mapping


def test_decode_block_size_must_be_a_multiple_of_prefills() -> None:
    assert pair_tp(2, 4, LLAMA_8B, prefill_block_size=16, decode_block_size=32).tp_ratio == 2
    with pytest.raises(ConfigError, match="decode --block-size 16 is not a multiple of prefill's 32"):
        pair_tp(2, 4, LLAMA_8B, prefill_block_size=32, decode_block_size=16)


def test_a_larger_prefill_tp_needs_equal_block_sizes_unless_the_kv_is_replicated() -> None:
    with pytest.raises(ConfigError, match="needs equal block sizes"):
        pair_tp(4, 2, LLAMA_8B, prefill_block_size=16, decode_block_size=32)
    assert pair_tp(4, 2, LLAMA_8B, prefill_block_size=16, decode_block_size=16).tp_ratio == -2
    assert pair_tp(4, 2, DEEPSEEK, prefill_block_size=16, decode_block_size=32).tp_ratio == -2


@pytest.mark.parametrize("tp", [0, -1, True, 1.5])
def test_a_tp_that_is_not_a_whole_number_is_refused(tp: object) -> None:
    with pytest.raises(ConfigError, match="prefill tensor-parallel size must be a whole number"):
        pair_tp(tp, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), 1),
        (("--tensor-parallel-size", "4"), 4),
        (("--tensor-parallel-size=2",), 2),
        (("-tp", "8"), 8),
        (("--tensor-parallel-size", "2", "--dtype", "bf16", "-tp=4"), 4),  # the last one wins, as argparse
    ],
)
def test_the_tp_is_read_from_vllm_arguments(args: tuple[str, ...], expected: int) -> None:
    assert tensor_parallel_size(args) == expected


def test_a_tp_or_block_size_that_is_not_a_number_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be a whole number >= 1, got 'two'"):
        tensor_parallel_size(("--tensor-parallel-size", "two"))
    with pytest.raises(ConfigError, match="--block-size"):
        block_size(("--block-size=0",))
    assert block_size(("--block-size", "32")) == 32
    assert block_size(()) is None


def test_the_kv_shape_is_read_from_config_json_as_vllm_reads_it() -> None:
    llama = {"model_type": "llama", "num_attention_heads": 64, "num_key_value_heads": 8}
    assert kv_shape_from_config(llama) == LLAMA_8B
    assert kv_shape_from_config({"num_attention_heads": 12}).num_kv_heads == 12  # no GQA: one per head
    assert kv_shape_from_config({"text_config": llama}) == LLAMA_8B  # a multimodal model's text model
    deepseek = kv_shape_from_config(
        {"model_type": "deepseek_v3", "kv_lora_rank": 512, "num_key_value_heads": 128}
    )
    assert deepseek.is_mla
    assert kv_shape_from_config({"num_key_value_heads": 2, "mamba_d_state": 128}).is_hybrid
    assert kv_shape_from_config({}) == KVShape()
