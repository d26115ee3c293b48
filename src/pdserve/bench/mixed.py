"""Traces of mixed traffic: every request draws its own prompt and answer lengths, and a seed draws the
whole trace, its phases' mixes and rates included.

A trace of one length per phase rewards a router that reads a phase's average; real traffic mixes short
chat turns beside long retrieval prompts, long answers beside short ones, and agents that send a burst of
very long prompts at once. Here a trace is a few phases, each a mix of request kinds:

- ``chat``: prompts log-normal around 300 tokens, answers around 200;
- ``rag``: retrieval prompts around 2,500 tokens, answers around 150;
- ``long-answer``: prompts around 500 tokens, answers around 800;
- ``agent``: very long prompts around 5,000 tokens (at most 6,000), short answers, sent in bursts.

``generate(seed, num_instances)`` draws the order of four phase mixes (chat-heavy, RAG-heavy, long
answers, agent bursts), each mix's shares around its own, and each phase's rate around what
``num_instances`` engines of an 8B model on an H200 serve of that mix (from 0.6x to 1.3x), so some phases
overload. Nothing in the draw knows the router: the seeds a benchmark runs were not picked by its scores.

Arrivals are Poisson in each stretch of constant rate, as bench/trace.py's; a phase's bursts add an
agent-only stream at the burst's rate on top of the base traffic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pdserve.bench.trace import Arrival
from pdserve.errors import ConfigError

_MAX_PROMPT = 6_000  # with the longest answer, within the 8,192-token context the profiles serve
_MAX_ANSWER = 2_000


@dataclass(frozen=True)
class Kind:
    """Requests whose prompt and answer lengths are log-normal: ``median · exp(sigma·N(0,1))``."""

    name: str
    prompt_median: int
    prompt_sigma: float
    answer_median: int
    answer_sigma: float

    def draw(self, rng: random.Random) -> tuple[int, int]:
        prompt = round(self.prompt_median * math.exp(self.prompt_sigma * rng.gauss(0, 1)))
        answer = round(self.answer_median * math.exp(self.answer_sigma * rng.gauss(0, 1)))
        return min(_MAX_PROMPT, max(8, prompt)), min(_MAX_ANSWER, max(2, answer))


CHAT = Kind("chat", 300, 0.8, 200, 0.7)
RAG = Kind("rag", 2_500, 0.5, 150, 0.6)
LONG_ANSWER = Kind("long-answer", 500, 0.7, 800, 0.5)
AGENT = Kind("agent", 5_000, 0.25, 100, 0.5)
KINDS = {k.name: k for k in (CHAT, RAG, LONG_ANSWER, AGENT)}


@dataclass(frozen=True)
class AgentBursts:
    """``rate`` agent requests/s for ``duration_s`` in every ``period_s``, at the period's end."""

    period_s: float
    duration_s: float
    rate: float


@dataclass(frozen=True)
class MixedPhase:
    """``duration_s`` of Poisson arrivals at ``rate``/s, each of a kind drawn by ``shares``
    (kind name -> weight), and optional agent bursts on top."""

    name: str
    duration_s: float
    rate: float
    shares: tuple[tuple[str, float], ...]
    bursts: AgentBursts | None = None

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.rate > 0 or not self.shares:
            raise ConfigError(f"a mixed phase needs duration_s, rate > 0 and shares: {self}")
        unknown = [k for k, _ in self.shares if k not in KINDS]
        if unknown:
            raise ConfigError(f"unknown request kinds {unknown}; known: {', '.join(KINDS)}")

    def describe(self) -> str:
        total = sum(w for _, w in self.shares)
        mix = " ".join(f"{k} {100 * w / total:.0f}%" for k, w in self.shares)
        burst = ""
        if self.bursts is not None:
            b = self.bursts
            burst = f" + agent bursts {b.rate:g}/s {b.duration_s:g}s/{b.period_s:g}s"
        return f"{self.name}: {self.duration_s:g} s of {self.rate:.1f}/s ({mix}){burst}"


@dataclass(frozen=True)
class MixedTrace:
    phases: tuple[MixedPhase, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("a trace needs at least one phase")

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def arrivals(self, seed: int = 0) -> list[Arrival]:
        """Every request in arrival order, lengths drawn per request; the same seed, the same list."""
        rng = random.Random(seed)
        timed: list[tuple[float, int, Kind]] = []
        offset = 0.0
        for k, phase in enumerate(self.phases):
            names = [name for name, _ in phase.shares]
            weights = [w for _, w in phase.shares]
            for t in _poisson(rng, offset, offset + phase.duration_s, phase.rate):
                timed.append((t, k, KINDS[rng.choices(names, weights)[0]]))
            if phase.bursts is not None:
                b, start = phase.bursts, 0.0
                while start < phase.duration_s:
                    end = min(start + b.period_s, phase.duration_s)
                    burst_start = max(start, end - b.duration_s)
                    for t in _poisson(rng, offset + burst_start, offset + end, b.rate):
                        timed.append((t, k, AGENT))
                    start += b.period_s
            offset += phase.duration_s
        timed.sort(key=lambda x: x[0])
        out = []
        for i, (t, k, kind) in enumerate(timed):
            prompt, answer = kind.draw(rng)
            out.append(Arrival(i, t, k, prompt, answer))
        return out


def _poisson(rng: random.Random, start: float, end: float, rate: float) -> list[float]:
    out, t = [], start + rng.expovariate(rate)
    while t < end:
        out.append(t)
        t += rng.expovariate(rate)
    return out


# Each phase's mix, and the rate per instance of an 8B model on an H200 it is drawn around: near what
# the layout that suits the mix best serves within a TTFT of a second and a TPOT of 25 ms (the
# simulator's llama3-8b-h200 profile), so some draws overload every layout and some none.
_MIXES: dict[str, tuple[dict[str, float], float]] = {
    "chat-heavy": ({"chat": 0.85, "rag": 0.1, "long-answer": 0.05}, 24.0),
    "rag-heavy": ({"rag": 0.7, "chat": 0.3}, 12.0),
    "long-answers": ({"long-answer": 0.6, "chat": 0.4}, 12.0),
    "agent-bursts": ({"chat": 0.8, "rag": 0.2}, 12.0),
}


def generate(seed: int, num_instances: int, phase_s: float = 20.0) -> MixedTrace:
    """A trace of the four mixes above in an order the seed draws, each mix's shares jittered (each
    weight times 0.5 to 1.5) and its rate ``num_instances`` × its per-instance rate × 0.6 to 1.3."""
    if num_instances < 1 or not phase_s > 0:
        raise ConfigError(
            f"a mixed trace needs num_instances >= 1 and phase_s > 0, got {num_instances}, {phase_s}"
        )
    rng = random.Random(f"mixed-trace-{seed}")
    names = list(_MIXES)
    rng.shuffle(names)
    phases = []
    for name in names:
        shares, per_instance = _MIXES[name]
        jittered = tuple((k, round(w * rng.uniform(0.5, 1.5), 3)) for k, w in shares.items())
        rate = round(num_instances * per_instance * rng.uniform(0.6, 1.3), 1)
        bursts = None
        if name == "agent-bursts":
            period = phase_s / 2
            # 30 to 60 % of each period is a wave of very long prompts: a layout must turn within seconds.
            bursts = AgentBursts(
                period,
                round(period * rng.uniform(0.3, 0.6), 1),
                round(num_instances * rng.uniform(1.0, 2.0), 1),
            )
        phases.append(MixedPhase(name, phase_s, rate, jittered, bursts))
    return MixedTrace(tuple(phases), seed)
