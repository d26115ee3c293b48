"""`pdserve plan`: how many prefill and decode instances a target load needs, or whether to split at all.

DistServe's question (Zhong et al., OSDI '24): the configuration with the highest goodput per instance,
goodput being the request rate served while a share of requests (``attainment``, 90 %) meets both the
TTFT and the TPOT SLO. The capacity model is the simulator's step-cost profile (sim/profile.py; shipped,
or fitted from a running vLLM by `pdserve sim calibrate`), the link the measured KV bandwidth:

- prefill instance: one prompt costs ``s = steps·step_base + prefill_per_token·L_in``; arrivals queue as
  M/D/1 (waiting time ≈ exponential of mean ``s/(2(1-ρ))`` with probability ρ);
- KV transfer: ``kv_pull_base + blocks·block_bytes/bandwidth``, then the request waits for decode's next
  step boundaries (about two decode steps) before its first token;
- decode instance: a step of B sequences costs ``a + b·B`` (b: per sequence plus its context); by Little's
  law ``B = λ·L_out·t``, so ``t = a/(1 - λ·L_out·b)`` is the TPOT;
- colocated instance: decodes and prefill chunks share steps, ``t = a/(1 - λ·(b·L_out + c·L_in))``; a
  request's TPOT grows with the prefills that land in its lifetime (Poisson, hence its spread) and its
  TTFT is the rest of the step in progress plus its own prefill step.

Each metric is held to the ``1 - (1 - attainment)/2`` quantile, so both together meet ``attainment``.
For a target rate the plan takes the fewest instances that serve it (ties: the higher capacity), and
advises colocation unless the split needs fewer instances (or, at equal counts, 5 % more capacity).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pdserve.bench.workload import Slo
from pdserve.errors import ConfigError
from pdserve.sim.profile import Profile

Decision = Literal["disaggregate", "colocate"]
_Z = {0.9: 1.2816, 0.95: 1.6449, 0.975: 1.96, 0.99: 2.3263}  # standard normal quantiles
_MARGIN = 1.05


@dataclass(frozen=True)
class PlanRequest:
    rate: float  # target requests/s
    input_len: int
    output_len: int
    slo: Slo  # ttft_ms and tpot_ms are required
    attainment: float = 0.9  # share of requests that must meet both SLOs
    kv_bandwidth_bytes_per_s: float | None = None  # None: the profile's own pull model
    max_instances: int = 64

    def __post_init__(self) -> None:
        if not self.rate > 0 or self.input_len < 1 or self.output_len < 2:
            raise ConfigError("plan needs rate > 0, input_len >= 1 and output_len >= 2")
        if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
            raise ConfigError("plan needs both a TTFT and a TPOT SLO (--slo ttft:MS tpot:MS)")
        if not 0.5 <= self.attainment < 1:
            raise ConfigError(f"plan attainment must be in [0.5, 1), got {self.attainment}")

    @property
    def quantile(self) -> float:
        return 1 - (1 - self.attainment) / 2


@dataclass(frozen=True)
class Config:
    num_prefill: int  # 0: colocated
    num_decode: int  # colocated: the number of instances
    capacity: float  # requests/s it serves within the SLOs

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def per_instance(self) -> float:
        return self.capacity / self.num_instances

    def describe(self) -> str:
        if self.num_prefill == 0:
            return f"{self.num_decode} colocated"
        return f"{self.num_prefill}P{self.num_decode}D"


@dataclass(frozen=True)
class Plan:
    decision: Decision
    disaggregated: Config | None  # the fewest P+D instances that serve the rate; None: none does
    colocated: Config | None
    prefill_s: float  # one prompt on an idle prefill instance
    kv_bytes: float  # one prompt's KV
    transfer_s: float
    lines: tuple[str, ...]  # the numbers behind the decision, in words

    @property
    def recommended(self) -> Config | None:
        return self.disaggregated if self.decision == "disaggregate" else self.colocated


class Model:
    """The arithmetic above for one profile, workload and link."""

    def __init__(self, profile: Profile, req: PlanRequest) -> None:
        self.p = (
            profile
            if req.kv_bandwidth_bytes_per_s is None
            else profile.with_kv_bandwidth(req.kv_bandwidth_bytes_per_s)
        )
        self.req = req
        self.z = _Z.get(round(req.quantile, 3), 1.6449)
        p, n_in, n_out = self.p, req.input_len, req.output_len
        steps = math.ceil(n_in / p.max_num_batched_tokens)
        self.prefill_s = steps * p.step_base_s + p.prefill_per_token_s * n_in
        blocks = math.ceil(n_in / p.block_size)
        self.kv_bytes = float(n_in * p.kv_bytes_per_token)
        self.transfer_s = p.pull_seconds(blocks)
        # Decode's cost per sequence in a step: its own share plus reading its context (mean length).
        self.per_seq_s = p.decode_per_seq_s + p.decode_per_ctx_token_s * (n_in + n_out / 2)

    def _decode_step(self, lam: float) -> tuple[float, float]:
        """(mean, quantile) step time of a decode instance taking ``lam`` requests/s."""
        load = lam * self.req.output_len * self.per_seq_s
        if load >= 1:
            return math.inf, math.inf
        step = self.p.step_base_s / (1 - load)
        batch = lam * self.req.output_len * step
        kv_tokens = batch * (self.req.input_len + self.req.output_len)
        if batch > self.p.max_num_seqs or kv_tokens > self.p.num_blocks * self.p.block_size:
            return math.inf, math.inf
        # The batch is a Poisson count (an M/G/inf system): a request may live with z·sqrt(B) more.
        return step, self.p.step_base_s + self.per_seq_s * (batch + self.z * math.sqrt(batch))

    def pd_latency(self, num_prefill: int, num_decode: int, rate: float) -> tuple[float, float]:
        """(TTFT, TPOT) quantiles in seconds of ``num_prefill``P``num_decode``D serving ``rate``/s."""
        s, q = self.prefill_s, self.req.quantile
        step, tpot = self._decode_step(rate / num_decode)
        wait = _wait_quantile(q, rate / num_prefill, s, num_prefill)
        if math.isinf(step) or math.isinf(wait):
            return math.inf, math.inf
        overhead = 2 * self.p.lone_request_overhead_s  # prefill's request, then decode's
        return overhead + s + wait + self.transfer_s + 2 * step, tpot

    def colocated_latency(self, num: int, rate: float) -> tuple[float, float]:
        p, n_in, n_out, q = self.p, self.req.input_len, self.req.output_len, self.req.quantile
        lam = rate / num
        prompt_s = p.prefill_per_token_s * n_in
        load = lam * (self.per_seq_s * n_out + prompt_s)
        if load >= 1:
            return math.inf, math.inf
        step = p.step_base_s / (1 - load)
        batch = lam * n_out * step
        if batch > p.max_num_seqs or batch * (n_in + n_out) > p.num_blocks * p.block_size:
            return math.inf, math.inf
        plain = p.step_base_s + self.per_seq_s * batch
        # Decodes take their tokens of the step's budget first, so a prompt may spill into more steps.
        num_steps = math.ceil((n_in + batch) / p.max_num_batched_tokens)
        own = num_steps * plain + prompt_s
        # It arrives during a plain decode step, or during the previous arrival's prefill step when
        # that came less than a prefill ago (round robin: gaps are Erlang, of ``num`` phases).
        gap = _erlang_quantile(1 - q, num, lam)
        residual = max(q * plain, own - gap)
        # Its TPOT: the prompts other requests bring during its lifetime each stretch one of its steps,
        # and stretch its lifetime too (during which more arrive): the fixed point of that count's
        # quantile (a Poisson count, thinned by round robin's regular gaps).
        long = plain + prompt_s
        extra = 0.0
        for _ in range(20):
            mean = lam * ((n_out - 1) * plain + extra * prompt_s)
            extra = mean + self.z * math.sqrt(mean / num) + 0.5
        tpot = ((n_out - 1 - extra) * plain + extra * long) / (n_out - 1)
        return p.lone_request_overhead_s + residual + own, max(tpot, step)

    def _meets(self, latency: tuple[float, float]) -> bool:
        ttft_ms, tpot_ms = self.req.slo.ttft_ms, self.req.slo.tpot_ms
        assert ttft_ms is not None and tpot_ms is not None
        return latency[0] * 1000 <= ttft_ms and latency[1] * 1000 <= tpot_ms

    def pd_capacity(self, num_prefill: int, num_decode: int) -> float:
        return _max_rate(lambda rate: self._meets(self.pd_latency(num_prefill, num_decode, rate)))

    def colocated_capacity(self, num: int) -> float:
        return _max_rate(lambda rate: self._meets(self.colocated_latency(num, rate)))


def _wait_quantile(q: float, lam: float, service_s: float, phases: int) -> float:
    """The q-quantile of the queueing delay at one instance serving fixed-time jobs (``service_s``)
    that arrive ``lam``/s with Erlang gaps of ``phases`` phases (round robin over that many instances;
    1: Poisson). The tail is ``P(W > t) ≈ ρ·exp(-θt)`` with θ the exact decay rate of the GI/D/1 queue,
    the root of ``θ·s = k·ln(1 + θ/(k·λ))``; ρ as the constant over-states the chance to wait."""
    rho = lam * service_s
    if rho >= 1:
        return math.inf
    if rho <= 1 - q or lam <= 0:
        return 0.0
    k = phases

    def excess(theta: float) -> float:
        return theta * service_s - k * math.log1p(theta / (k * lam))

    lo, hi = 1e-9, 1.0 / service_s
    while excess(hi) < 0:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return math.log(rho / (1 - q)) / hi


def _erlang_quantile(p: float, phases: int, lam: float) -> float:
    """The p-quantile of an Erlang gap of ``phases`` phases and mean ``1/lam``."""
    rate = phases * lam

    def cdf(t: float) -> float:
        x, term, total = rate * t, 1.0, 0.0
        for n in range(phases):
            if n:
                term *= x / n
            total += term
        return 1 - math.exp(-x) * total

    lo, hi = 0.0, 1.0 / lam
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return hi


def _max_rate(is_ok: Callable[[float], bool]) -> float:
    """The highest rate (requests/s) for which ``is_ok(rate)`` holds; monotone by construction."""
    if not is_ok(1e-6):
        return 0.0
    lo, hi = 1e-6, 1.0
    while is_ok(hi) and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if is_ok(mid) else (lo, mid)
    return lo


def plan(profile: Profile, req: PlanRequest) -> Plan:
    m = Model(profile, req)
    best_pd: Config | None = None
    for total in range(2, req.max_instances + 1):
        fits = [Config(x, total - x, m.pd_capacity(x, total - x)) for x in range(1, total)]
        fits = [c for c in fits if c.capacity >= req.rate]
        if fits:
            best_pd = max(fits, key=lambda c: c.capacity)
            break
    coloc = None
    for n in range(1, req.max_instances + 1):
        capacity = m.colocated_capacity(n)
        if capacity >= req.rate:
            coloc = Config(0, n, capacity)
            break
    decision: Decision = "colocate"
    if best_pd is not None and (
        coloc is None
        or best_pd.num_instances < coloc.num_instances
        or (best_pd.num_instances == coloc.num_instances and best_pd.capacity > coloc.capacity * _MARGIN)
    ):
        decision = "disaggregate"
    return Plan(
        decision,
        best_pd,
        coloc,
        m.prefill_s,
        m.kv_bytes,
        m.transfer_s,
        tuple(_explain(m, best_pd, coloc, decision)),
    )


def _explain(m: Model, pd: Config | None, coloc: Config | None, decision: Decision) -> list[str]:
    req, p = m.req, m.p
    bandwidth = p.kv_bandwidth_bytes_per_s
    link = "no per-block cost" if math.isinf(bandwidth) else f"{bandwidth / 1e9:.2f} GB/s"
    lines = [
        f"target {req.rate:g} req/s of {req.input_len} prompt + {req.output_len} output tokens; SLOs {req.slo.describe()} "
        f"for {req.attainment:.0%} of requests; profile {p.name}",
        f"one prompt: prefill {m.prefill_s * 1000:.1f} ms on an idle instance; its KV {m.kv_bytes / 1e6:.1f} MB, "
        f"{m.transfer_s * 1000:.1f} ms to move at {link}",
    ]
    ttft_ms = req.slo.ttft_ms or 0.0
    floor_ms = (m.prefill_s + m.transfer_s + 2 * p.step_base_s + 2 * p.lone_request_overhead_s) * 1000
    if floor_ms > ttft_ms:
        lines.append(f"split TTFT cannot go below {floor_ms:.1f} ms (prefill + transfer + decode's first steps): "
                     f"over the {ttft_ms:g} ms SLO before any queueing")  # fmt: skip
    one_p, one_d = m.pd_capacity(1, 10**6), m.pd_capacity(10**6, 1)
    lines.append(f"alone within the SLOs (Poisson arrivals): a prefill instance {one_p:.2f} req/s, a decode "
                 f"instance {one_d:.2f} req/s, a colocated one {m.colocated_capacity(1):.2f} req/s")  # fmt: skip
    for name, config in (("disaggregated", pd), ("colocated", coloc)):
        if config is None:
            lines.append(
                f"{name}: no configuration of at most {req.max_instances} instances serves {req.rate:g} req/s"
            )
        else:
            lines.append(f"{name}: {config.describe()} serves up to {config.capacity:.2f} req/s "
                         f"({config.per_instance:.2f} per instance; at the target {req.rate / config.num_instances:.2f})")  # fmt: skip
    if decision == "disaggregate" and pd is not None:
        lines.append(f"plan: DISAGGREGATE {pd.describe()} (P:D = {pd.num_prefill}:{pd.num_decode})")
    elif coloc is not None:
        plural = "s" if coloc.num_decode != 1 else ""
        lines.append(f"plan: COLOCATE {coloc.num_decode} instance{plural}: splitting does not pay here")
    else:
        lines.append(
            "plan: neither layout meets these SLOs at this rate; relax the SLOs or shorten the requests"
        )
    return lines
