"""The flag groups several commands share, and the configs built from them: the proxy's settings (``up``,
``proxy``), the topology (``up``, ``bench``, ``demo``).

Each group fills one frozen config part (``Timeouts``, ``Routing``, ``Retries``, each role's ``PoolSpec``,
...); defaults come from those configs themselves, never restated here. A topology flag left out is
None, so a ``--config`` file's value stands unless the flag is given.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.config import INSTANCE_ROLES, ROLES, ProxySettings, Role, Timeouts, proxy_default
from pdserve.configparts import (
    AdmissionLimits,
    ApiKeys,
    ElasticPool,
    HealthChecks,
    PoolSpec,
    Retries,
    Routing,
)
from pdserve.costmodel import Costs
from pdserve.errors import ConfigError
from pdserve.patience import LIMIT_S, STALL_S, Waiting
from pdserve.proxy.pool.policies import POLICIES
from pdserve.slo import Slo
from pdserve.topology import Topology
from pdserve.topologyfile import load_topology, resource_pairs

T = TypeVar("T")


def add_proxy_settings(p: argparse.ArgumentParser) -> None:
    """Every flag of ``ProxySettings``, grouped as its parts are."""
    add_routing(p)
    add_elastic_pool(p)
    add_retries(p)
    add_admission(p)
    add_health(p)
    add_api_keys(p)
    add_timeouts(p)
    g = p.add_argument_group("proxy processes and tracing")
    g.add_argument("--workers", type=int, default=proxy_default("workers"),
                   help="proxy processes sharing the port (SO_REUSEPORT), each with its share of "
                        "--max-concurrent/--max-queued; one CPython process is about one core of proxy")  # fmt: skip
    g.add_argument("--max-connections-per-upstream", type=int, default=proxy_default("max_connections_per_upstream"),
                   metavar="N", help="pooled keep-alive connections to one instance")  # fmt: skip
    g.add_argument("--first-token-at-once", action="store_true",
                   help="a greedy or seeded stream gets prefill's token as soon as prefill answers, decode's "
                        "stream going on after it (docs/handover.md)")  # fmt: skip
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="send OpenTelemetry spans of every request to this OTLP/HTTP traces URL (…/v1/traces)")  # fmt: skip


def proxy_settings_from_args(a: argparse.Namespace, topology: Topology | None = None) -> ProxySettings:
    """The settings of those flags; ``--kv-lease`` (a topology flag on ``up``) when given. ``topology``:
    what ``up`` starts, whose engine gives the elastic pool's step costs when ``--cost-profile`` does not,
    and whose roles the pools are (`proxy`: an elastic pool with --instance)."""
    kv_lease_s = a.kv_lease_s if a.kv_lease_s is not None else proxy_default("kv_lease_s")
    is_elastic = topology.is_elastic if topology is not None else bool(getattr(a, "instance", None))
    return ProxySettings(
        pools=pools_from_args(a, is_elastic),
        timeouts=timeouts_from_args(a),
        routing=routing_from_args(a),
        elastic_pool=elastic_pool_from_args(a, topology),
        retries=retries_from_args(a),
        admission=admission_from_args(a),
        health=health_from_args(a),
        api_keys=api_keys_from_args(a),
        max_connections_per_upstream=a.max_connections_per_upstream,
        kv_lease_s=kv_lease_s,
        workers=a.workers,
        otlp_traces_endpoint=a.otlp_traces_endpoint,
        first_token_at_once=a.first_token_at_once,
    )


def add_timeouts(p: argparse.ArgumentParser) -> None:
    d = Timeouts()
    g = p.add_argument_group("timeouts (seconds)")
    g.add_argument("--connect-timeout", type=float, default=d.connect, help="TCP connect to an instance")
    g.add_argument("--prefill-timeout", type=float, default=d.prefill, help="the whole prefill call")
    g.add_argument(
        "--first-token-timeout",
        type=float,
        default=d.first_token,
        help="streamed decode: until the first chunk",
    )
    g.add_argument("--idle-timeout", type=float, default=d.idle, help="streamed decode: gap between chunks")
    g.add_argument(
        "--decode-timeout", type=float, default=d.decode, help="non-streamed decode: the whole call"
    )
    g.add_argument("--request-timeout", type=float, default=d.request,
                   help="one request, every attempt and retry together (its overall deadline)")  # fmt: skip


def timeouts_from_args(a: argparse.Namespace) -> Timeouts:
    return Timeouts(
        a.connect_timeout,
        a.prefill_timeout,
        a.first_token_timeout,
        a.idle_timeout,
        a.decode_timeout,
        a.request_timeout,
    )


def pools_from_args(a: argparse.Namespace, is_elastic: bool) -> tuple[PoolSpec, ...]:
    """Each role's policy and attempt limit (``fronting`` gives the pools their instances). An elastic
    pool's members take either part with one policy and one limit: its flags for the two must agree."""
    prefill = PoolSpec("prefill", policy=a.prefill_policy, max_attempts=a.max_prefill_attempts)
    decode = PoolSpec("decode", policy=a.decode_policy, max_attempts=a.max_decode_attempts)
    if not is_elastic:
        return prefill, decode
    for what, flags, given in (
        ("one policy", ("--prefill-policy", "--decode-policy"), (prefill.policy, decode.policy)),
        ("one attempt limit", ("--max-prefill-attempts", "--max-decode-attempts"),
         (prefill.max_attempts, decode.max_attempts)),
    ):  # fmt: skip
        if given[0] != given[1]:
            raise ConfigError(
                f"an elastic pool's instances take either part of a request, with {what}: "
                f"{flags[0]} {given[0]} and {flags[1]} {given[1]} must agree"
            )
    return (PoolSpec("elastic", policy=decode.policy, max_attempts=decode.max_attempts),)


def add_routing(p: argparse.ArgumentParser) -> None:
    d, pool = Routing(), PoolSpec("prefill")
    g = p.add_argument_group("routing")
    g.add_argument("--prefill-policy", default=pool.policy, help=f"one of {', '.join(sorted(POLICIES))}")
    g.add_argument("--decode-policy", default=pool.policy, help="as --prefill-policy")
    g.add_argument("--skip-prefill-below", type=int, default=d.skip_prefill_below_tokens, metavar="TOKENS",
                   help="uncached prompts shorter than this go straight to decode (needs a tokenizer); 0: never")  # fmt: skip
    g.add_argument("--prefix-load-cost", type=float, default=d.prefix_load_cost_tokens, metavar="TOKENS",
                   help="prefix_aware: cached prompt tokens worth one more request ahead in a queue")  # fmt: skip


def add_prompt_model(p: argparse.ArgumentParser) -> None:
    """`pdserve proxy`'s view of the engines' model (`up` knows it: it starts them)."""
    d = Routing()
    p.add_argument(
        "--tokenizer", metavar="DIR", help="model dir with tokenizer.json, for prompt-aware routing"
    )
    p.add_argument("--block-size", type=int, default=d.prefix_block_size,
                   help="the engines' KV block size (vLLM --block-size)")  # fmt: skip


def routing_from_args(a: argparse.Namespace) -> Routing:
    d = Routing()
    return Routing(
        # Only `pdserve proxy` has these two; `up` learns them from the engines it starts.
        tokenizer=getattr(a, "tokenizer", d.tokenizer),
        prefix_block_size=getattr(a, "block_size", d.prefix_block_size),
        prefix_load_cost_tokens=a.prefix_load_cost,
        skip_prefill_below_tokens=a.skip_prefill_below,
    )


def add_elastic_pool(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("elastic pool (up --elastic N, proxy --instance URL)")
    g.add_argument("--slo", nargs="+", default=[], metavar="KEY:MS",
                   help="per-request objectives the pool's layout is chosen to meet, e.g. ttft:500 tpot:50 "
                        "(both or neither; default: the lowest latency)")  # fmt: skip
    g.add_argument("--cost-profile", metavar="NAME|PATH",
                   help="the engines' step costs the pool plans with: a simulator profile (shipped name or "
                        "YAML), or none (long prompts split, short ones whole). Default: up --engine sim's "
                        "own profile; tiny-cpu for up --model tiny on cpu; none otherwise")  # fmt: skip
    g.add_argument("--hold-max-s", type=float, default=ElasticPool.hold_max_s, metavar="S",
                   help="with a TPOT objective, requests wait at the proxy while every decode-side instance "
                        "runs the most it allows, at most S seconds (0: never held; default: %(default)s)")  # fmt: skip
    g.add_argument("--pin-prefill", type=int, metavar="N",
                   help="keep N instances on the prefill side (0: all serve whole requests) instead of the "
                        "layout the plan picks (step costs needed); placement and the hold work as ever")  # fmt: skip


def elastic_pool_from_args(a: argparse.Namespace, topology: Topology | None = None) -> ElasticPool:
    name = a.cost_profile if a.cost_profile is not None else default_cost_profile(topology)
    pool = topology.elastic if topology is not None else None
    if pool is not None and a.pin_prefill is not None and a.pin_prefill >= pool.count:
        raise ConfigError(f"--pin-prefill {a.pin_prefill} leaves no instance of the {pool.count} to decode: "
                          f"give at most {pool.count - 1}")  # fmt: skip
    return ElasticPool(costs=_costs(name), slo=Slo.parse(a.slo, flag="--slo"), hold_max_s=a.hold_max_s,
                       num_prefill=a.pin_prefill, measure_at_start=True)  # fmt: skip


def default_cost_profile(topology: Topology | None) -> str | None:
    """The profile whose costs an elastic pool started by ``up`` plans with unless told: the simulator's
    own; for the tiny test model on vllm-cpu the one measured there; else none, since a profile of other
    hardware or another model would mislead the planner more than no plan."""
    if topology is None:
        return None
    if topology.engine == "sim":
        return topology.sim_profile
    return "tiny-cpu" if topology.model == "tiny" and topology.device == "cpu" else None


def _costs(profile: str | None) -> Costs | None:
    if profile is None or profile == "none":
        return None
    from pdserve.sim.profile import load_profile  # the profiles live with the simulator that runs them

    return load_profile(profile).costs()


def add_retries(p: argparse.ArgumentParser) -> None:
    d, pool = Retries(), PoolSpec("prefill")
    g = p.add_argument_group("retries")
    g.add_argument("--max-prefill-attempts", type=int, default=pool.max_attempts, metavar="N",
                   help="tries on distinct prefill instances before giving up")  # fmt: skip
    g.add_argument("--max-decode-attempts", type=int, default=pool.max_attempts, metavar="N",
                   help="tries on distinct decode instances before the first token")  # fmt: skip
    g.add_argument("--retry-backoff", type=float, default=d.first_backoff_s, metavar="S",
                   help="seconds before the first retry of a phase; doubling after, at most 1 s")  # fmt: skip
    g.add_argument("--fallback-to-local-prefill", action=argparse.BooleanOptionalAction,
                   default=d.fallback_to_local_prefill,
                   help="when every prefill attempt fails or none is in service, decode computes the prompt "
                        "itself (--no-fallback-to-local-prefill: the client gets prefill's error)")  # fmt: skip
    g.add_argument("--prefill-stands-in", action=argparse.BooleanOptionalAction, default=d.prefill_stands_in,
                   help="when no decode can serve (none in service, or the only one failed before the first "
                        "byte), a prefill instance serves the request whole (--no-prefill-stands-in: the "
                        "client gets decode's error)")  # fmt: skip
    g.add_argument("--migrate-streams", action=argparse.BooleanOptionalAction, default=d.migrate_streams,
                   help="a stream whose decode fails after the client has tokens goes on from another instance "
                        "(--no-migrate-streams: it ends with an error event)")  # fmt: skip
    g.add_argument("--max-migrations", type=int, default=d.max_migrations, metavar="N",
                   help="times one stream may go on from another instance")  # fmt: skip


def retries_from_args(a: argparse.Namespace) -> Retries:
    return _part(Retries, a, first_backoff_s="retry_backoff", fallback_to_local_prefill="", prefill_stands_in="",
                 migrate_streams="", max_migrations="")  # fmt: skip


def add_admission(p: argparse.ArgumentParser) -> None:
    d = AdmissionLimits()
    g = p.add_argument_group("admission")
    g.add_argument(
        "--max-concurrent", type=int, help="requests in flight at most; more queue (default: unbounded)"
    )
    g.add_argument("--max-queued", type=int, default=d.max_queued,
                   help="requests waiting beyond --max-concurrent; more get 429")  # fmt: skip
    g.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s,
                   help="seconds a queued request may wait (then 503)")  # fmt: skip
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="BYTES",
                   help="a larger request body gets 413")  # fmt: skip
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                   help="a client connection whose request headers take longer (from its first byte, or "
                        "from connect) is closed (408 if it had begun)")  # fmt: skip
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                   help="a request body still incomplete this long after its headers: the connection is closed")  # fmt: skip
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_s, metavar="S",
                   help="an idle kept-alive client connection is closed after this long")  # fmt: skip
    g.add_argument("--max-client-connections", type=int, default=d.max_connections, metavar="N",
                   help="client connections open at most (each holds a file descriptor); one more is "
                        "answered 503 and closed")  # fmt: skip
    g.add_argument("--max-decode-wait", type=float, default=d.max_decode_wait_s, metavar="S",
                   help="a request waits at the proxy, before prefill, while its decode would not renew the KV's "
                        "lease in time (handoffs slow to reach it, or its engine not stepping); at most S "
                        "seconds, then 503 (0: never waits; default: %(default)s)")  # fmt: skip


def admission_from_args(a: argparse.Namespace) -> AdmissionLimits:
    return _part(AdmissionLimits, a, max_concurrent="", max_queued="", queue_timeout_s="queue_timeout",
                 max_body_bytes="", header_timeout_s="header_timeout", body_timeout_s="body_timeout",
                 keep_alive_s="keep_alive_timeout", max_connections="max_client_connections",
                 max_decode_wait_s="max_decode_wait")  # fmt: skip


def add_health(p: argparse.ArgumentParser) -> None:
    d = HealthChecks()
    g = p.add_argument_group("health checks and circuit breakers")
    g.add_argument("--health-interval", type=float, default=d.interval_s, metavar="S",
                   help="seconds between health checks of every instance")  # fmt: skip
    g.add_argument("--health-timeout", type=float, default=d.timeout_s, metavar="S",
                   help="one health check's wait for /health")  # fmt: skip
    g.add_argument("--unhealthy-after-checks", type=int, default=d.unhealthy_after_checks, metavar="N",
                   help="consecutive failed checks that take an instance out of service")  # fmt: skip
    g.add_argument("--breaker-threshold", type=int, default=d.breaker_threshold, metavar="N",
                   help="consecutive failed requests that open an instance's circuit")  # fmt: skip
    g.add_argument("--breaker-cooldown", type=float, default=d.breaker_cooldown_s, metavar="S",
                   help="seconds an open circuit waits before one trial request")  # fmt: skip
    g.add_argument("--warmup-timeout", type=float, default=d.warmup_timeout_s, metavar="S",
                   help="seconds a returning instance may spend meeting its peers (a canary handoff per "
                        "pair warms the NIXL handshakes) before it takes requests; 0: no warm-up")  # fmt: skip
    g.add_argument("--rest-after-stranded-pushes", type=int, default=d.rest_after_stranded_pushes, metavar="N",
                   help="a push decode that may hold the KV blocks of N pushes that never came (only a "
                        "restart frees them) takes requests only when no other can, until its supervisor "
                        "restarts it; 0: never")  # fmt: skip


def health_from_args(a: argparse.Namespace) -> HealthChecks:
    return _part(HealthChecks, a, interval_s="health_interval", timeout_s="health_timeout",
                 unhealthy_after_checks="", breaker_threshold="", breaker_cooldown_s="breaker_cooldown",
                 warmup_timeout_s="warmup_timeout", rest_after_stranded_pushes="")  # fmt: skip


def add_api_keys(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API keys")
    g.add_argument("--api-key", help="clients must send Authorization: Bearer KEY")
    g.add_argument("--admin-api-key",
                   help="enables the admin API (/admin/...) with this key, and puts /requests behind it")  # fmt: skip
    g.add_argument("--upstream-api-key", metavar="KEY",
                   help="sent to the instances as Authorization: Bearer KEY (vLLM's --api-key)")  # fmt: skip
    g.add_argument("--show-instance-urls", action="store_true",
                   help="client-facing errors name instances by URL, not by pool name (decode-0)")  # fmt: skip


def api_keys_from_args(a: argparse.Namespace) -> ApiKeys:
    return _part(ApiKeys, a, client="api_key", admin="admin_api_key", upstream="upstream_api_key",
                 show_instance_urls="")  # fmt: skip


def _part(cls: Callable[..., T], a: argparse.Namespace, **dests: str) -> T:
    """A config part from the parsed flags: each field from the flag's ``dest`` named beside it ("": the
    field's own name)."""
    return cls(**{field: getattr(a, dest or field) for field, dest in dests.items()})


def add_topology(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="topology file; flags given explicitly override it")
    p.add_argument("--model", help="tiny (random, fast), a model dir or hub name (default: SmolLM2-135M)")
    for role in ROLES:
        p.add_argument(f"--{role}", type=int, dest="role_counts", action=_PerRole, role=role,
                       is_repeatable=False, metavar="N", help=f"number of {role} instances (default 1)")  # fmt: skip
    p.add_argument("--elastic", type=int, dest="role_counts", action=_PerRole, role="elastic",
                   is_repeatable=False, metavar="N",
                   help="instead of --prefill/--decode: an elastic pool of N instances (elastic-0, ...) that "
                        "each take any role; the proxy splits a request or serves it whole, per request")  # fmt: skip
    p.add_argument("--port", type=int, dest="proxy_port", help="proxy port (default 8000)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    for role in INSTANCE_ROLES:
        p.add_argument(f"--{role}-host", dest="role_hosts", action=_PerRole, role=role, metavar="ADDR",
                       help=f"{_a(role)} {role} instance's own address, one per instance (repeatable): it binds "
                            "there and prefill advertises it to decode as its NIXL side channel (default --host)")  # fmt: skip
    p.add_argument("--first-port", type=int, help="first instance HTTP port (default 8100)")
    p.add_argument("--first-side-channel-port", type=int, help="first NIXL side-channel port (default 5600)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="cpu (vllm-cpu) or cuda (official vllm)")
    p.add_argument("--engine", choices=("vllm", "sim"), help="vllm (default) or pdserve's simulator")
    p.add_argument("--sim-profile", help="simulator timing profile: zero, a shipped name, or a YAML file")
    p.add_argument(
        "--engine-python", help="python of the vLLM venv (default: .venv-engine, $PDSERVE_ENGINE_PYTHON)"
    )
    p.add_argument("--run-dir", help="directory for instance logs (default runs/<time>)")
    p.add_argument("--startup-timeout", type=float, help="seconds for every instance to become healthy")
    p.add_argument("--kv-lease", type=float, dest="kv_lease_s",
                   help="seconds prefill holds KV nobody pulls (vLLM's kv_lease_duration; default 30)")  # fmt: skip
    p.add_argument("--kv-transfer", choices=("pull", "push"),
                   help="how prefill's KV reaches decode: decode reads it once prefill answered (pull, the "
                        "default), or prefill writes it into blocks decode registered while prefill ran "
                        "(push: vLLM's NixlPushConnector; docs/handover.md)")  # fmt: skip
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run each instance as a Ray actor on the cluster at ADDRESS (host:port, or auto), at its "
                        "node's IP (pip install 'pdserve[ray]'; docs/deploying.md)")  # fmt: skip
    for role in INSTANCE_ROLES:
        p.add_argument(f"--{role}-resource", dest="role_resources", action=_PerRole, role=role, metavar="NAME=N",
                       help=f"a Ray resource each {role} instance needs, e.g. pdserve_{role}=1 (repeatable)")  # fmt: skip
    p.add_argument("--on-instance-exit", choices=("restart", "stop"),
                   help="an instance that exits is restarted with backoff while the rest serve (restart, the "
                        "default), or stops everything (stop)")  # fmt: skip
    p.add_argument(
        "--vllm-arg",
        action="append",
        dest="vllm_args",
        metavar="ARG",
        help="extra vLLM argument, e.g. --vllm-arg=--dtype=float32 (repeatable)",
    )


def topology_from_args(a: argparse.Namespace) -> Topology:
    base = load_topology(a.config) if a.config else Topology()
    names = ("model", "proxy_port", "host", "first_port", "engine", "sim_profile", "first_side_channel_port",
             "device", "engine_python", "run_dir", "startup_timeout", "kv_lease_s", "kv_transfer", "on_instance_exit", "ray")  # fmt: skip
    given: dict[str, Any] = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    if a.vllm_args:
        given["vllm_args"] = (*base.vllm_args, *a.vllm_args)
    counts, hosts, resources = a.role_counts or {}, a.role_hosts or {}, a.role_resources or {}
    for role in INSTANCE_ROLES:
        spec: dict[str, Any] = {}
        if role in counts:
            spec["count"] = counts[role]
        if role in hosts:
            spec["hosts"] = tuple(hosts[role])
        if role in resources:
            pairs = [item.partition("=") for item in resources[role]]
            spec["resources"] = resource_pairs(f"--{role}-resource", {k: v for k, _, v in pairs})
        if spec:
            given[role] = dataclasses.replace(base.role(role), **spec)
    return dataclasses.replace(base, **given)


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _PerRole(argparse.Action):
    """A role's flag, kept under its role: ``--prefill 2 --decode-host A --decode-host B`` gives
    ``role_counts == {"prefill": 2}`` and ``role_hosts == {"decode": ["A", "B"]}``. Counts take the
    last value given; the other per-role flags are repeatable."""

    def __init__(
        self, option_strings: list[str], dest: str, *, role: Role, is_repeatable: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.role = role
        self.is_repeatable = is_repeatable

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option: str | None = None,
    ) -> None:
        by_role = dict(getattr(namespace, self.dest) or {})
        by_role[self.role] = [*by_role.get(self.role, []), values] if self.is_repeatable else values
        setattr(namespace, self.dest, by_role)


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def add_waiting(p: argparse.ArgumentParser) -> None:
    """How long a tool waits for its own requests on a busy system (pdserve.patience)."""
    p.add_argument("--stall-after", type=_seconds, default=STALL_S, metavar="S",
                   help="give up on a request when no instance's token counters moved for S seconds "
                   f"(default {STALL_S:g}); while they move, a queued request is waited for")  # fmt: skip
    p.add_argument("--max-wait", type=_seconds, default=LIMIT_S, metavar="S",
                   help=f"give up on a request after S seconds however busy the system (default {LIMIT_S:g})")  # fmt: skip


def waiting_from_args(a: argparse.Namespace) -> Waiting:
    return Waiting(a.stall_after, a.max_wait)
