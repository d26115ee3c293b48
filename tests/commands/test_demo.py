"""The demo's judge of its answers: exact text only where every instance computes in float32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from pdserve import kvproof
from pdserve.commands.demo import fresh_notes, messages_for, tolerance_of


@dataclass(frozen=True)
class _Spec:
    args: tuple[str, ...]


@dataclass(frozen=True)
class _Topology:
    device: str = "cpu"


@dataclass(frozen=True)
class _Stack:
    specs: tuple[_Spec, ...]
    topology: _Topology = _Topology()


def _tolerance(*args: tuple[str, ...], device: str = "cpu") -> kvproof.Tolerance:
    return tolerance_of(cast(Any, _Stack(tuple(_Spec(a) for a in args), _Topology(device))))


def test_float32_on_every_instance_in_either_spelling_is_judged_exactly() -> None:
    assert _tolerance(("--dtype", "float32"), ("--dtype=float32",)) == kvproof.FLOAT32


def test_the_last_dtype_given_counts_as_vllm_reads_it() -> None:
    assert _tolerance(("--dtype=bfloat16", "--dtype", "float32"), ("--dtype", "float32")) == kvproof.FLOAT32
    assert _tolerance(("--dtype", "float32", "--dtype=bfloat16"), ("--dtype", "float32")) == kvproof.BF16


def test_an_instance_of_another_or_no_stated_dtype_gets_bf16_bounds() -> None:
    assert _tolerance(("--dtype", "float32"), ("--dtype", "bfloat16")) == kvproof.BF16
    assert _tolerance(("--dtype", "float32"), ()) == kvproof.BF16


def test_float32_on_a_gpu_gets_bf16_bounds_as_exactness_was_only_measured_on_the_cpu() -> None:
    assert _tolerance(("--dtype", "float32"), ("--dtype", "float32"), device="cuda") == kvproof.BF16


def test_each_question_comes_after_fresh_notes_several_blocks_long() -> None:
    first, second = messages_for("Q?", fresh_notes()), messages_for("Q?", fresh_notes())
    assert first[-1] == {"role": "user", "content": "Q?"}
    one, two = first[0]["content"].split(), second[0]["content"].split()
    assert len(one) >= kvproof.min_prompt_tokens(None)  # a token a word at least
    assert one[:12] != two[:12] and one[-12:] != two[-12:]  # fresh early and late
