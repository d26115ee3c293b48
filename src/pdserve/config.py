"""Frozen, validated configuration of the proxy (what `pdserve up` launches is topology.py's).

The CLI builds these; nothing mutates them afterwards (derive a variant with ``dataclasses.replace``).
Each ``__post_init__`` raises ``ConfigError`` naming the field, so a bad flag fails at start, not mid-request.
``ProxyConfig`` composes the parts in configparts.py (a ``PoolSpec`` per role, routing, retries,
admission, health, keys, discovery).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from pdserve.configparts import INSTANCE_ROLES as INSTANCE_ROLES
from pdserve.configparts import ROLES as ROLES
from pdserve.configparts import (
    AdmissionLimits,
    ApiKeys,
    ElasticPool,
    HealthChecks,
    K8sDiscovery,
    PoolSpec,
    Retries,
    Routing,
    check_port,
    check_positive,
)
from pdserve.configparts import Role as Role
from pdserve.configparts import normalize_url as normalize_url
from pdserve.errors import ConfigError
from pdserve.labels import label_selector

MAX_WORKERS: Final = 64
ELASTIC_ALONE: Final = (
    "an elastic pool has instances of any role: give them as --instance only "
    "(not with --prefill or --colocated)"
)


@dataclass(frozen=True)
class Timeouts:
    """Limits in seconds. The per-phase ones apply to each attempt: one that runs out ends that attempt
    with a 504 naming the phase and instance, and a retry on another instance gets its own limit.
    ``request`` bounds them all together: every attempt, backoff and lease retry of one request, up to
    the moment its answer starts (streamed) or is complete (whole)."""

    connect: float = 5.0  # TCP connect to any instance
    prefill: float = 300.0  # whole prefill call (max_tokens=1), queueing included
    first_token: float = 300.0  # streamed decode: until its first chunk (the KV pull happens here)
    idle: float = 120.0  # streamed decode: longest gap between two chunks
    decode: float = 900.0  # non-streamed decode: the whole call, since nothing arrives before the end
    request: float = 1800.0  # one request, all attempts together (see above)

    def __post_init__(self) -> None:
        check_positive("timeouts", **dataclasses.asdict(self))


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    """How the proxy behaves, whatever it fronts: what `pdserve up` is told before its instances exist.
    ``ProxyConfig`` is these plus where it listens and which instances it serves (``fronting``)."""

    # Each role's pool as far as it is known: its routing policy and attempt limit, and once ``fronting``
    # names them, its instances. A role not listed here gets PoolSpec's defaults.
    pools: tuple[PoolSpec, ...] = ()
    timeouts: Timeouts = field(default_factory=Timeouts)
    routing: Routing = field(default_factory=Routing)
    elastic_pool: ElasticPool = field(default_factory=ElasticPool)
    retries: Retries = field(default_factory=Retries)
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    health: HealthChecks = field(default_factory=HealthChecks)
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    max_connections_per_upstream: int = 512  # pooled keep-alive connections to one instance
    # The instances' kv_lease_duration: the lease guard judges answers by it, and a handoff's params go to
    # a second decode only while younger than half of it (proxy/kv/ledger.py, Handoff.is_fresh).
    kv_lease_s: float = 30.0
    # Proxy processes serving the port together (SO_REUSEPORT; proxy/serving/workers.py): each enforces its share
    # of the admission limits, and answers the reads (/metrics, ledger, requests) for them all.
    workers: int = 1
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL (…/v1/traces): spans of every request
    # A greedy or seeded stream gets prefill's sampled token as soon as prefill answers, decode's stream
    # going on after it (docs/handover.md); off by default: it needs decode to sample the very same token,
    # which float32 gives and bf16 may not (a different token ends the stream with an error event).
    first_token_at_once: bool = False

    def __post_init__(self) -> None:
        check_positive(
            "proxy",
            max_connections_per_upstream=self.max_connections_per_upstream,
            kv_lease_s=self.kv_lease_s,
        )
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"proxy.workers must be in 1..{MAX_WORKERS}, got {self.workers}")
        roles = [pool.role for pool in self.pools]
        for role in INSTANCE_ROLES:
            if roles.count(role) > 1:
                raise ConfigError(f"proxy.pools has {roles.count(role)} {role} pools: give each role one")

    def fronting(
        self,
        members: Mapping[Role, Sequence[str]],
        *,
        host: str,
        port: int,
        discovery: K8sDiscovery | None = None,
        selectors: Mapping[Role, str | None] | None = None,
    ) -> ProxyConfig:
        """The whole config of a proxy with these settings, listening at ``host:port`` in front of a pool
        for each role of ``members`` (role → its instances' URLs) and of ``selectors`` (role → the label
        selector ``discovery`` finds its pods by), each with that role's policy and limit in ``pools``."""
        given = {pool.role: pool for pool in self.pools}
        found = {role: text for role, text in (selectors or {}).items() if text is not None}
        pools = tuple(
            dataclasses.replace(
                given.get(role, PoolSpec(role)), urls=tuple(members.get(role, ())), selector=found.get(role)
            )
            for role in INSTANCE_ROLES
            if role in members or role in found
        )
        # Every setting as it is: ProxyConfig is a ProxySettings, so each name is one of its parameters,
        # and a setting added later is carried without a list here to keep in step.
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(ProxySettings)}
        return ProxyConfig(host, port, discovery or K8sDiscovery(), **{**settings, "pools": pools})


@dataclass(frozen=True)
class ProxyConfig(ProxySettings):
    """A proxy's whole config: its settings (keyword-only) plus where it listens and what it fronts.

    What it fronts is its ``pools``, one per role, as ``Topology`` holds a ``RoleSpec`` per role: prefill
    and decode; decode alone (colocated: nothing is split, each request goes whole to one of them, the
    baseline `pdserve bench --compare` measures disaggregation against); or an elastic pool, whose
    members take either part per request (proxy/pool/elastic.py, ``elastic_pool``). ``pool(role)`` is
    the pool that takes a role's part of a request, so code that names instances iterates the pools and
    never asks which of the three layouts it is."""

    host: str = "127.0.0.1"
    port: int = 8000
    discovery: K8sDiscovery = field(default_factory=K8sDiscovery)
    # Worked out from ``pools`` at construction, since a request reads them on its path: the pool that
    # takes each role's part (``pool``), and whether a request may be split at all (a colocated proxy
    # has no pool that prefills).
    _parts: dict[Role, PoolSpec] = field(init=False, repr=False, compare=False)
    can_split: bool = field(init=False, repr=False, compare=False)

    @classmethod
    def pd(cls, prefill: Sequence[str], decode: Sequence[str], **settings: Any) -> ProxyConfig:
        """A prefill/decode proxy in front of these instances, each pool with the default policy and limit."""
        return cls(pools=(PoolSpec("prefill", tuple(prefill)), PoolSpec("decode", tuple(decode))), **settings)

    def __post_init__(self) -> None:
        super().__post_init__()
        # An elastic pool's members take either part; a part no pool takes has an empty one.
        own = {pool.role: pool for pool in self.pools}
        parts = {role: own.get(role) or own.get("elastic") or PoolSpec(role) for role in INSTANCE_ROLES}
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "can_split", any(pool.role != "decode" for pool in self.pools))
        # With discovery a role's pool may start empty: its pods join once they are Ready.
        roles = self.roles()
        if "elastic" in roles and len(roles) > 1:
            raise ConfigError(ELASTIC_ALONE)
        if "prefill" in roles and not self.pool("prefill").has_members:
            raise ConfigError(
                "proxy needs at least one prefill instance (--prefill URL or --k8s-prefill-selector)"
            )
        if not self.pool("decode").has_members:
            raise ConfigError(
                "proxy needs at least one decode instance (--decode URL or --k8s-decode-selector), or "
                "instances of any role (--instance URL)"
            )
        selectors = [(p.role, label_selector(p.selector)) for p in self.pools if p.selector is not None]
        for (one, parsed), (other, same) in itertools.combinations(selectors, 2):
            if parsed == same:
                raise ConfigError(f"proxy.k8s_{one}_selector and k8s_{other}_selector must differ")
        check_port("proxy", "port", self.port)

    def roles(self) -> tuple[Role, ...]:
        """The roles of its pools, in plan order (prefill first)."""
        return tuple(pool.role for pool in self.pools)

    def pool(self, role: Role) -> PoolSpec:
        """The pool that takes ``role``'s part of a request (an elastic pool takes both); one with no
        members and the defaults where none does (a colocated proxy's prefill)."""
        return self._parts[role]

    @property
    def is_discovering(self) -> bool:
        """Whether some pool's members are found on Kubernetes (proxy/pool/discovery.py)."""
        return any(pool.selector is not None for pool in self.pools)

    def worker_share(self) -> ProxyConfig:
        """What each of ``workers`` processes enforces: its share of the admission limits, rounded up."""
        if self.workers == 1:
            return self
        elastic = dataclasses.replace(self.elastic_pool, traffic_share=1 / self.workers)
        return dataclasses.replace(self, admission=self.admission.share(self.workers), elastic_pool=elastic)

    @property
    def models_timeout_s(self) -> float:
        """One /v1/models question to an instance: its connect, then as long as a health check may wait."""
        return self.timeouts.connect + self.health.timeout_s


def proxy_default(name: str) -> Any:
    """``ProxyConfig``'s own default for a plain field, so a flag's default never restates (and drifts from) it."""
    return next(f.default for f in dataclasses.fields(ProxyConfig) if f.name == name)


def lease_warnings(config: ProxyConfig) -> list[str]:
    """What in ``config`` can outlast prefill's KV lease, in words for the start-up log.

    Prefill keeps a handoff's KV for ``kv_lease_s``; decode's heartbeats extend it only once decode's
    engine has the request (docs/vllm-kv-lifecycle.md). What can pass between prefill's answer and that
    moment is the proxy's own doing: connect attempts and backoffs before a decode takes the request.
    When those limits reach the lease, a handoff can expire in the proxy's hands; pdserve then prefills
    again rather than hand it on, which costs time, so they deserve a warning, not a refusal.
    """
    lease, t, attempts = config.kv_lease_s, config.timeouts, config.pool("decode").max_attempts
    warnings = []
    reach = attempts * t.connect + sum(config.retries.backoff(n) for n in range(1, attempts))
    if reach >= lease / 2:
        warnings.append(
            f"{attempts} decode attempts x connect timeout {t.connect:g} s (+ backoff) "
            f"reach half the KV lease ({lease:g} s): a retried handoff would rarely still be held; "
            "raise --kv-lease or lower --connect-timeout"
        )
    if lease < 10:
        warnings.append(
            f"KV lease {lease:g} s: a decode engine that stalls longer (GC pause, swapping, an overloaded "
            "host) finds its KV released; pdserve detects that and prefills again, at the cost of a retry"
        )
    return warnings
