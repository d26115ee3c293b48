"""The `pdserve` command line.

up        start N prefill + M decode instances (or an elastic pool of N) and the proxy, on this host or Ray
proxy     the proxy alone, in front of running instances (given, or discovered on Kubernetes)
k8s       `pdserve k8s render`: the Kubernetes manifests of a PD deployment
verify    prove through a running proxy that KV moves over NIXL
trace     one request's timeline from the proxy and the instances' logs
top       a live view of the instances behind a proxy
doctor    per prefill→decode pair: does the handoff work, and does it pay?
bench     vLLM's benchmark client against a URL, or --compare: PD vs colocated
plan      the P:D ratio for a target rate and SLOs, or the advice to colocate
demo      up + verify + one request walked through, then shut down
sim       simulated vLLM instances; `pdserve sim calibrate URL` fits a profile
model     build the embedded tiny model if needed and print its path
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from pdserve.commands import flags
from pdserve.config import ELASTIC_ALONE, ProxyConfig, Role, proxy_default
from pdserve.errors import ConfigError, PDServeError


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
    from pdserve.proxy.serving.server import tune_gc
    from pdserve.stack import Stack

    _raise_on_sigterm()
    tune_gc()  # this process runs the proxy (on a thread) for as long as it lives
    topology = flags.topology_from_args(a)
    stack_ = Stack(topology, proxy=flags.proxy_settings_from_args(a, topology), proxy_log_level=a.log_level)
    with stack_ as stack:
        doctor_lines: list[str] = []
        # An elastic pool's instances are checked as a ring: each prefills for the next (doctor/run.py).
        if a.doctor:
            # Brief: one canary per pair, so a link that makes the split cost more than it saves is
            # said at start-up, not found by users later (`pdserve doctor` says more). It runs before
            # "pdserve is up" and the URLs: a client started on that line meets no canary traffic.
            from pdserve.doctor.run import brief

            print("\nchecking each prefill→decode pair ...", flush=True)
            doctor_lines = brief(stack.proxy_url, [str(stack.run_dir)])
        print("\npdserve is up:")
        for line in (*stack.describe(), *doctor_lines):
            print("  " + line)
        print("Ctrl-C stops everything.", flush=True)
        while True:
            # --on-instance-exit stop: an instance that dies takes the whole stack down, loudly;
            # restart: the supervisor brings it back and this never raises.
            stack.check_alive()
            time.sleep(1.0)


def cmd_proxy(a: argparse.Namespace) -> int:
    from pdserve.proxy.serving.workers import serve

    serve(proxy_config_from_args(a), a.log_level)
    return 0


def proxy_config_from_args(a: argparse.Namespace) -> ProxyConfig:
    """`pdserve proxy`'s config: a pool per role its flags give (prefill and decode; decode alone with
    --colocated; an elastic pool with --instance), each with its URLs and its pods' label selector."""
    from pdserve.k8s.command import k8s_discovery

    if a.instance and a.decode:
        raise ConfigError(
            "an elastic pool has instances of any role: give them as --instance only (not with --decode)"
        )
    if a.colocated and (a.instance or a.prefill or a.k8s_prefill_selector):
        raise ConfigError(
            ELASTIC_ALONE
            if a.instance
            else "a colocated proxy splits nothing: give its instances as --decode only"
        )
    members: dict[Role, tuple[str, ...]] = {"prefill": tuple(a.prefill), "decode": tuple(a.decode)}
    if a.instance:  # its pods are found by the decode selector; a prefill beside it, the config refuses
        members = {"elastic": tuple(a.instance), **({"prefill": members["prefill"]} if a.prefill else {})}
    elif a.colocated:
        del members["prefill"]
    selectors: dict[Role, str | None] = {
        "prefill": a.k8s_prefill_selector,
        "elastic" if a.instance else "decode": a.k8s_decode_selector,
    }
    return flags.proxy_settings_from_args(a).fronting(
        members, host=a.host, port=a.port, discovery=k8s_discovery(a), selectors=selectors
    )


def cmd_verify(a: argparse.Namespace) -> int:
    from pdserve.commands.verify import verify

    print(f"verifying {a.url} ...")
    report = verify(a.url, admin_key=a.admin_api_key, waiting=flags.waiting_from_args(a))
    print("\n".join(report.lines()))
    print("verify: " + ("all checks passed" if report.ok else "FAILED"))
    return 0 if report.ok else 1


def cmd_top(a: argparse.Namespace) -> int:
    from pdserve.commands.top import run

    return run(a.url, a.interval, a.once)


def cmd_trace(a: argparse.Namespace) -> int:
    from pdserve.commands.trace import trace_request

    print("\n".join(trace_request(a.url, a.request_id, a.logs, a.admin_api_key)))
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from pdserve.doctor.report import render
    from pdserve.doctor.run import diagnose

    say = (lambda m: print(m, file=sys.stderr, flush=True)) if a.json else (lambda m: print(m, flush=True))
    waiting = flags.waiting_from_args(a)
    report = diagnose(a.url, a.logs or (), a.prompt_tokens, a.admin_api_key, say=say, waiting=waiting)
    print(report.to_json() if a.json else "\n".join(render(report)))
    return report.exit_code


def cmd_bench(a: argparse.Namespace) -> int:
    from pdserve.bench.command import run_bench_command

    _raise_on_sigterm()
    return run_bench_command(a, flags.topology_from_args(a))


def cmd_plan(a: argparse.Namespace) -> int:
    from pdserve.bench.command import run_plan_command

    return run_plan_command(a)


def cmd_demo(a: argparse.Namespace) -> int:
    from pdserve.commands.demo import run_demo

    _raise_on_sigterm()
    topology = flags.topology_from_args(a)
    if topology.is_elastic:
        raise ConfigError(
            "demo walks one request through a prefill/decode pair: run `pdserve up --elastic N`"
        )
    return run_demo(topology, keep=a.keep, waiting=flags.waiting_from_args(a))


def cmd_sim(a: argparse.Namespace) -> int:
    """`pdserve sim [...]` serves simulated instances; `pdserve sim calibrate URL` fits a profile."""
    if a.sim_args[:1] == ["calibrate"]:
        from pdserve.sim.calibrate import main as calibrate

        return calibrate(a.sim_args[1:])
    from pdserve.sim.command import main as serve_sim

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

    up = sub.add_parser("up", help="start N prefill + M decode vLLM instances (or --elastic N) and the proxy")
    flags.add_topology(up)
    flags.add_proxy_settings(up)
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
    proxy.add_argument("--instance", action="append", default=[], metavar="URL",
                       help="an instance of an elastic pool, able to take any role (repeatable; instead of "
                            "--prefill/--decode): the proxy splits a request or serves it whole, per request")  # fmt: skip
    proxy.add_argument("--port", type=int, default=proxy_default("port"))
    proxy.add_argument("--host", default=proxy_default("host"))
    proxy.add_argument("--kv-lease", type=float, dest="kv_lease_s", default=proxy_default("kv_lease_s"),
                       help="the instances' kv_lease_duration in seconds: the lease guard reasons with it")  # fmt: skip
    flags.add_prompt_model(proxy)
    from pdserve.k8s.command import add_k8s_discovery

    add_k8s_discovery(proxy)
    flags.add_proxy_settings(proxy)
    proxy.set_defaults(func=cmd_proxy)

    from pdserve.k8s.command import add_k8s_render

    add_k8s_render(sub)

    ver = sub.add_parser("verify", help="prove through a running proxy that KV moves over NIXL")
    ver.add_argument("url", help="the proxy, e.g. http://127.0.0.1:8000")
    ver.add_argument("--admin-api-key",
                     help="the proxy's admin key, if it has one (to read /requests, and for the reference "
                     "answer through the proxy where verify cannot reach the instances)")  # fmt: skip
    flags.add_waiting(ver)
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
    flags.add_waiting(doc)
    doc.set_defaults(func=cmd_doctor)

    from pdserve.bench.command import add_bench_arguments, add_plan_arguments

    bench = sub.add_parser(
        "bench", help="vLLM's benchmark client against a URL, or --compare: PD vs colocated"
    )
    add_bench_arguments(bench)
    flags.add_topology(bench)
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("plan", help="the P:D ratio for a target rate and SLOs, or the advice to colocate")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    demo = sub.add_parser("demo", help="up + verify + a request walk-through, then shut down")
    flags.add_topology(demo)
    demo.add_argument("--keep", action="store_true", help="leave the system running afterwards")
    flags.add_waiting(demo)
    demo.set_defaults(func=cmd_demo)

    sim = sub.add_parser(
        "sim",
        help="simulated vLLM instances (`pdserve sim --help`); `pdserve sim calibrate URL` fits a profile",
        add_help=False,
    )
    sim.add_argument("sim_args", nargs=argparse.REMAINDER)
    sim.set_defaults(func=cmd_sim)

    model = sub.add_parser(
        "model", help="build the default model (SmolLM2-135M-Instruct) if needed and print its path"
    )
    model.add_argument(
        "--model", help="resolve this instead: tiny (the random test model), a directory, a hub name"
    )
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
