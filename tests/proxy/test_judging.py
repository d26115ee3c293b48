"""The elastic router's judgement of one request (proxy/pool/judging.py): what a whole stream's TPOT is
judged against counts only the prompts its instance computed while it was decoding."""

from __future__ import annotations

import pytest

from pdserve.proxy.pool import judging
from pdserve.sim.profile import load_profile

H200 = load_profile("llama3-8b-h200").costs()


def test_only_prompts_placed_after_a_stream_and_computed_before_it_ended_stretch_its_steps() -> None:
    prompts = [
        (0.5, 0.56, 2500),  # placed before it: computed before its first token
        (1.2, 1.26, 2500),  # in its lifetime
        (1.5, 1.56, 2500),  # in its lifetime
        (2.9, 3.1, 2500),  # placed in its lifetime, computed after its last token
    ]
    # Placed at 1.0, first token at 1.05, last at 3.0: 195 gaps of 10 ms.
    per_step = judging.stretch(H200, prompts, 1.0, 3.0, 1.95, 0.01)
    assert per_step * 195 == pytest.approx(0.121, rel=0.01)  # the two prompts' 5,000 tokens at 24.2 us


def test_a_stream_that_ended_before_its_first_token_was_counted_is_stretched_by_nothing() -> None:
    assert judging.stretch(H200, [(1.2, 1.26, 2500)], 1.0, 1.3, 0.0, 0.01) == 0.0
    assert judging.stretch(H200, [], 1.0, 3.0, 1.95, 0.01) == 0.0
