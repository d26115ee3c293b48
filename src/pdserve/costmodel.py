"""The cost model: what a request's TTFT and TPOT will be on a layout of instances, from an engine's step
costs and the load. One model, used by `pdserve plan` (how many instances, split or not), doctor's verdict
and the elastic pool's router (which layout its instances should take now).

The arithmetic (DistServe's question, Zhong et al., OSDI '24, answered with the simulator's step model):

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
Pure arithmetic: no I/O, no clock, importable from every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.errors import ConfigError
from pdserve.slo import Slo

_Z = {0.9: 1.2816, 0.95: 1.6449, 0.975: 1.96, 0.99: 2.3263}  # standard normal quantiles


@dataclass(frozen=True)
class Costs:
    """An engine's step costs and capacity (the simulator's ``Profile`` carries them: ``Profile.costs``).

    A step takes ``step_base_s + prefill_per_token_s·(prompt tokens) + decode_per_seq_s·(sequences)
    + decode_per_ctx_token_s·(their context tokens)``; a pull of n blocks ``kv_pull_base_s +
    kv_pull_per_block_s·n``."""

    name: str = "zero"
    step_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_per_ctx_token_s: float = 0.0
    request_overhead_s: float = 0.0
    frontend_per_request_s: float = 0.0
    kv_pull_base_s: float = 0.0
    kv_pull_per_block_s: float = 0.0
    block_size: int = 16
    num_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_bytes_per_token: int = 1024

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"costs {self.name!r}: {name} must be >= 1")

    @property
    def lone_request_overhead_s(self) -> float:
        """What a request alone spends before the scheduler sees it (no burst to wait behind)."""
        return self.request_overhead_s + self.frontend_per_request_s

    def pull_seconds(self, num_blocks: int) -> float:
        return self.kv_pull_base_s + self.kv_pull_per_block_s * num_blocks

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def kv_bandwidth_bytes_per_s(self) -> float:
        """The link bandwidth the pull model implies (inf when pulls cost nothing per block)."""
        return self.block_bytes / self.kv_pull_per_block_s if self.kv_pull_per_block_s > 0 else math.inf

    def with_kv_bandwidth(self, bytes_per_s: float) -> Costs:
        """These costs over a link of ``bytes_per_s`` (the per-block pull cost derived from it)."""
        if not bytes_per_s > 0:
            raise ConfigError(f"costs {self.name!r}: KV bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        return replace(self, kv_pull_per_block_s=self.block_bytes / bytes_per_s)


@dataclass(frozen=True)
class Calibration:
    """What was measured over what the model predicted, per kind of layout (whole: colocated; split):
    the factor each predicted TTFT and TPOT is multiplied by. It corrects what the step costs do not
    know: another GPU than the profile's, instances sharing one GPU, arrivals in bursts."""

    whole_ttft: float = 1.0
    whole_tpot: float = 1.0
    split_ttft: float = 1.0
    split_tpot: float = 1.0

    def __post_init__(self) -> None:
        bad = {name: value for name, value in vars(self).items() if not value > 0}  # NaN included
        if bad:
            raise ConfigError(f"calibration factors must be > 0, got {bad}")

    def factors(self, is_split: bool) -> tuple[float, float]:
        """(TTFT, TPOT) factors of a layout that splits, or not."""
        if is_split:
            return self.split_ttft, self.split_tpot
        return self.whole_ttft, self.whole_tpot


@dataclass(frozen=True)
class Load:
    """The traffic the model is asked about: ``rate`` requests/s of ``input_len`` prompt tokens (those not
    cached) asking ``output_len`` tokens each; ``attainment`` the share that must meet the SLO."""

    rate: float
    input_len: int
    output_len: int
    attainment: float = 0.9
    # The prompt lengths' squared coefficient of variation (variance over the mean squared): 0 when every
    # prompt has ``input_len`` tokens. Mixed lengths queue longer than their mean says (a short prompt
    # waits behind a long one: M/G/1's 1 + cv² over M/D/1) and stall colocated decodes in lumps.
    input_cv2: float = 0.0

    def __post_init__(self) -> None:
        if not self.rate > 0 or self.input_len < 1 or self.output_len < 2:
            raise ConfigError(
                f"the cost model needs rate > 0, input_len >= 1 and output_len >= 2, got {self}"
            )
        if not self.input_cv2 >= 0:
            raise ConfigError(f"input_cv2 must be >= 0, got {self.input_cv2}")
        if not 0.5 <= self.attainment < 1:
            raise ConfigError(f"attainment must be in [0.5, 1), got {self.attainment}")

    @property
    def quantile(self) -> float:
        return 1 - (1 - self.attainment) / 2


class Model:
    """The arithmetic above for one engine's costs, one load and one SLO (``slo`` None: no capacity
    questions, latencies only)."""

    def __init__(
        self, costs: Costs, req: Load, slo: Slo | None = None, calibration: Calibration | None = None
    ) -> None:
        self.p = costs
        self.req = req
        self.slo = slo
        self.calibration = calibration
        self.z = _Z.get(round(req.quantile, 3), 1.6449)
        p, n_in, n_out = self.p, req.input_len, req.output_len
        steps = math.ceil(n_in / p.max_num_batched_tokens)
        self.prefill_s = steps * p.step_base_s + p.prefill_per_token_s * n_in
        blocks = math.ceil(n_in / p.block_size)
        self.kv_bytes = float(n_in * p.kv_bytes_per_token)
        self.transfer_s = p.pull_seconds(blocks)
        # Decode's cost per sequence in a step: its own share plus reading its context (mean length).
        self.per_seq_s = step_share(p, n_in, n_out, whole=False)

    def decode_step_s(self, num_decode: int, rate: float) -> float:
        """The mean step of each of ``num_decode`` decode instances sharing ``rate`` requests/s, times the
        calibration's split TPOT factor when there is one (inf: overloaded)."""
        step = self._decode_step(rate / num_decode)[0]
        return step * (self.calibration.split_tpot if self.calibration is not None else 1.0)

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
        wait = _wait_quantile(q, rate / num_prefill, s, num_prefill) * (1 + self.req.input_cv2)
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
            # Prompts of mixed lengths: the stretch is a compound Poisson sum, its spread 1 + cv² times.
            extra = mean + self.z * math.sqrt(mean * (1 + self.req.input_cv2) / num) + 0.5
        tpot = ((n_out - 1 - extra) * plain + extra * long) / (n_out - 1)
        return p.lone_request_overhead_s + residual + own, max(tpot, step)

    def latency(self, num_prefill: int, num_decode: int, rate: float) -> tuple[float, float]:
        """(TTFT, TPOT) quantiles of a layout: ``num_prefill`` 0 is ``num_decode`` colocated instances;
        times the calibration's factors when there is one."""
        if num_prefill == 0:
            ttft, tpot = self.colocated_latency(num_decode, rate)
        else:
            ttft, tpot = self.pd_latency(num_prefill, num_decode, rate)
        if self.calibration is None:
            return ttft, tpot
        ttft_factor, tpot_factor = self.calibration.factors(num_prefill > 0)
        return ttft * ttft_factor, tpot * tpot_factor

    def capacity(self, num_prefill: int, num_decode: int) -> float:
        """The highest rate the layout serves within the SLO (``num_prefill`` 0: colocated)."""
        assert self.slo is not None, "capacity needs an SLO"
        slo = self.slo
        return _max_rate(lambda rate: slo.meets(*self.latency(num_prefill, num_decode, rate)))

    def max_batch(self, is_split: bool, whole_tokens: float | None = None) -> float:
        """The most sequences one instance may run at once with their TPOT within the SLO, by the step
        costs: a step of B costs ``a + b·B`` and, serving whole, also the prompts the B bring (``c·L_in``
        each over ``L_out`` steps). Not calibrated: a calibration factor measured under overload is the
        load estimate's lag, not the steps'. inf: no TPOT objective, or one a lone sequence misses.
        ``whole_tokens``: the prompt tokens a request brings to compute there, on average (a split
        layout's decode side computing the short prompts itself); by default all of ``L_in`` served
        whole, none split. The batch is held to the TPOT quantile, as the layouts are: a step of B costs
        ``a + b·(B + z·√B)`` at it, the B streams' lengths and the prompts they bring swinging as a
        Poisson count does. At the mean alone every stream of an instance there misses the objective
        whenever its batch draws longer contexts or more prompts than the average (a wave of agents'
        5,000-token prompts on a split layout's decode side at TPOT 10 ms: all of them missed)."""
        if self.slo is None or self.slo.tpot_ms is None:
            return math.inf
        per_seq = self.per_seq_s
        if whole_tokens is None:
            whole_tokens = 0.0 if is_split else self.req.input_len
        per_seq += self.p.prefill_per_token_s * whole_tokens / self.req.output_len
        return batch_within(self.p, self.slo.tpot_ms / 1000, per_seq, self.z)


def batch_within(costs: Costs, tpot_s: float, per_seq_s: float, z: float) -> float:
    """The most sequences, each adding ``per_seq_s`` to a step, that one instance runs with its step
    within ``tpot_s`` at the quantile ``z`` (``Model.max_batch``); inf: no bound (a lone one misses, or
    they cost nothing)."""
    if not per_seq_s > 0:
        return math.inf
    most = (tpot_s - costs.step_base_s) / per_seq_s  # at the mean step
    if most < 1:
        return math.inf
    root = (-z + math.sqrt(z**2 + 4 * most)) / 2  # B + z·√B = most
    return max(1.0, root**2)


def step_share(costs: Costs, input_len: int, output_len: int, whole: bool) -> float:
    """What one sequence adds to each step of the instance that decodes it, on average over its life:
    its own share and its context (half its answer grown), and, computed there whole, its prompt spread
    over its answer's steps."""
    share = costs.decode_per_seq_s + costs.decode_per_ctx_token_s * (input_len + output_len / 2)
    if whole:
        share += costs.prefill_per_token_s * input_len / max(1, output_len)
    return share


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


@dataclass(frozen=True)
class Layout:
    """A way to use N instances (``num_prefill`` 0: all serve whole requests) and what the model
    predicts for it under a load: TTFT and TPOT quantiles; ``slack``, the smaller of SLO/TTFT and
    SLO/TPOT (>= 1 meets both) or, with no SLO, minus the predicted end-to-end time; and ``capacity``,
    the highest rate it serves within the SLO (None without one)."""

    num_prefill: int
    num_decode: int
    ttft_s: float
    tpot_s: float
    slack: float
    capacity: float | None = None

    @property
    def is_split(self) -> bool:
        return self.num_prefill > 0

    @property
    def meets_slo(self) -> bool:
        return self.capacity is not None and self.slack >= 1

    def describe(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D" if self.is_split else f"{self.num_decode} colocated"


def rank_layouts(
    costs: Costs, num_instances: int, load: Load, slo: Slo | None, calibration: Calibration | None = None
) -> list[Layout]:
    """Every layout of ``num_instances`` (colocated, 1P(N-1)D … (N-1)P1D), best first. With an SLO:
    those that meet it at this load, then the rest, each by capacity (the highest rate it serves within
    the SLO at these lengths). Capacity, not slack, orders those that meet it: traffic moves by its rate
    first, and a layout that meets the SLO with little headroom in rate (2P6D at 30 of its 36 req/s of
    2,000-token prompts) builds a queue at the first rise that takes long to drain, where one with less
    latency slack but three times the headroom absorbs it. Overloaded, the most requests within the SLO
    is the goodput left to save. Without an SLO: the lowest end-to-end latency. Ties go to colocation."""
    with_slo = slo is not None and slo.ttft_ms is not None and slo.tpot_ms is not None
    m = Model(costs, load, slo if with_slo else None, calibration)
    layouts = []
    for x in range(num_instances):
        n = num_instances - x
        ttft, tpot = m.latency(x, n, load.rate)
        capacity = None
        if with_slo:
            assert slo is not None and slo.ttft_ms is not None and slo.tpot_ms is not None
            slack = min(slo.ttft_ms / 1000 / ttft if ttft > 0 else math.inf,
                        slo.tpot_ms / 1000 / tpot if tpot > 0 else math.inf)  # fmt: skip
            capacity = m.capacity(x, n)
        else:
            slack = -(ttft + (load.output_len - 1) * tpot)
        layouts.append(Layout(x, n, ttft, tpot, 0.0 if math.isnan(slack) else slack, capacity))

    def key(lay: Layout) -> tuple[int, float, int]:
        if lay.capacity is None:
            return (0, -lay.slack, lay.num_prefill)
        return (0 if lay.meets_slo else 1, -lay.capacity, lay.num_prefill)

    return sorted(layouts, key=key)
