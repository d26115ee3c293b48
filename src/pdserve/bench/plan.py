"""`pdserve plan`: how many prefill and decode instances a target load needs, or whether to split at all.

DistServe's question (Zhong et al., OSDI '24): the configuration with the highest goodput per instance,
goodput being the request rate served while a share of requests (``attainment``, 90 %) meets both the
TTFT and the TPOT SLO. The capacity model is costmodel.py's (the one the elastic pool's router and
doctor's verdict use) over the simulator's step-cost profile (sim/profile.py; shipped, or fitted from a
running vLLM by `pdserve sim calibrate`), the link the measured KV bandwidth.

For a target rate the plan takes the fewest instances that serve it (ties: the higher capacity), and
advises colocation unless the split needs fewer instances (or, at equal counts, 5 % more capacity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pdserve.costmodel import Load, Model
from pdserve.errors import ConfigError
from pdserve.sim.profile import Profile
from pdserve.slo import Slo

Decision = Literal["disaggregate", "colocate"]
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

    def model(self, profile: Profile) -> Model:
        costs = profile.costs()
        if self.kv_bandwidth_bytes_per_s is not None:
            costs = costs.with_kv_bandwidth(self.kv_bandwidth_bytes_per_s)
        return Model(costs, Load(self.rate, self.input_len, self.output_len, self.attainment), self.slo)


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


def plan(profile: Profile, req: PlanRequest) -> Plan:
    m = req.model(profile)
    best_pd: Config | None = None
    for total in range(2, req.max_instances + 1):
        fits = [Config(x, total - x, m.capacity(x, total - x)) for x in range(1, total)]
        fits = [c for c in fits if c.capacity >= req.rate]
        if fits:
            best_pd = max(fits, key=lambda c: c.capacity)
            break
    coloc = None
    for n in range(1, req.max_instances + 1):
        capacity = m.capacity(0, n)
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
        tuple(_explain(m, req, best_pd, coloc, decision)),
    )


def _explain(
    m: Model, req: PlanRequest, pd: Config | None, coloc: Config | None, decision: Decision
) -> list[str]:
    p = m.p
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
    one_p, one_d = m.capacity(1, 10**6), m.capacity(10**6, 1)
    lines.append(f"alone within the SLOs (Poisson arrivals): a prefill instance {one_p:.2f} req/s, a decode "
                 f"instance {one_d:.2f} req/s, a colocated one {m.capacity(0, 1):.2f} req/s")  # fmt: skip
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
