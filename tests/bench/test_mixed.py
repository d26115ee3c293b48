"""Mixed-length traces (bench/mixed.py): a seed draws the trace and every request's lengths, the same seed
the same requests; lengths are each request's own, within the context the profiles serve; agent bursts
land in their windows."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from pdserve.bench.mixed import AGENT, CHAT, RAG, AgentBursts, MixedPhase, MixedTrace, generate
from pdserve.errors import ConfigError


def test_a_seed_draws_one_trace_and_one_list_of_requests() -> None:
    a, b = generate(3, 4), generate(3, 4)
    assert a == b and a.arrivals(3) == b.arrivals(3)
    other = generate(4, 4)
    assert other != a
    assert {p.name for p in a.phases} == {"chat-heavy", "rag-heavy", "long-answers", "agent-bursts"}
    assert a.duration_s == pytest.approx(4 * 20.0)
    orders = {tuple(p.name for p in generate(seed, 4).phases) for seed in range(6)}
    assert len(orders) > 1  # the seed draws the phases' order too


def test_every_request_has_its_own_lengths_within_the_context() -> None:
    arrivals = generate(0, 4, phase_s=10).arrivals(0)
    prompts = [a.input_len for a in arrivals]
    answers = [a.output_len for a in arrivals]
    assert len(set(prompts)) > len(prompts) // 4 and len(set(answers)) > len(answers) // 8
    assert all(
        8 <= p <= 6_000 and 2 <= o <= 2_000 and p + o <= 8_192 for p, o in zip(prompts, answers, strict=True)
    )
    assert [a.index for a in arrivals] == list(range(len(arrivals)))
    assert all(x.at <= y.at for x, y in itertools.pairwise(arrivals))


def test_kinds_are_log_normal_around_their_medians() -> None:
    rng = random.Random(0)
    for kind in (CHAT, RAG, AGENT):
        prompts = [kind.draw(rng)[0] for _ in range(2_000)]
        assert statistics.median(prompts) == pytest.approx(kind.prompt_median, rel=0.1)


def test_agent_bursts_send_very_long_prompts_in_their_windows() -> None:
    phase = MixedPhase("calm", 10.0, 5.0, (("chat", 1.0),), AgentBursts(5.0, 1.0, 40.0))
    arrivals = MixedTrace((phase,)).arrivals(1)
    long = [a for a in arrivals if a.input_len > 3_000]
    assert len(long) > 40
    assert all(a.at % 5.0 >= 4.0 or a.at % 5.0 == 0 for a in long)  # the last second of each period


def test_a_phase_rejects_unknown_kinds_and_empty_traces() -> None:
    with pytest.raises(ConfigError, match="unknown request kinds"):
        MixedPhase("x", 1.0, 1.0, (("video", 1.0),))
    with pytest.raises(ConfigError, match="at least one phase"):
        MixedTrace(())
