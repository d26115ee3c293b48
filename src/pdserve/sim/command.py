"""``python -m pdserve.sim``: serve simulated vLLM instances until Ctrl-C.

    python -m pdserve.sim --prefill 2 --decode 2 --first-port 8100 --profile zero

Ports run from ``--first-port`` upwards, prefill instances first, then decode, then "both"
(``--first-port 0`` takes free ports from the OS). Once every instance accepts requests, one line per
instance is printed: ``<role> <url> engine_id=<id>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from pdserve.errors import ConfigError
from pdserve.sim.faults import FaultSpec
from pdserve.sim.fleet import SimInstanceSpec, run_sim
from pdserve.sim.profile import load_profile
from pdserve.sim.replica import SimInstance
from pdserve.sim.types import SimRole


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve sim", description="Serve simulated vLLM instances (NixlConnector PD)."
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    p.add_argument("--both", type=int, default=0, help="instances that serve whole requests (default 0)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--first-port", type=int, default=8100, help="0: free ports from the OS")
    p.add_argument("--profile", default="zero", help="zero, a shipped profile name, or a YAML file")
    p.add_argument("--served-model-name", help="override the profile's model name")
    p.add_argument("--max-model-len", type=int, help="override the profile's max_model_len")
    p.add_argument("--kv-lease-s", type=float, help="override how long prefill holds un-pulled KV")
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int,
        help="override the profile's TP size: what prefill tells decode (tp_size), and what decode pairs "
        "with it by vLLM's rules",
    )  # fmt: skip
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, as vLLM's flag of that name",
    )
    faults = p.add_argument_group("faults (also settable at runtime: POST /sim/faults)")
    faults.add_argument("--fail-rate", type=float, default=0.0, help="share of requests answered 500")
    faults.add_argument("--hang-rate", type=float, default=0.0, help="share of requests never answered")
    faults.add_argument("--drop-rate", type=float, default=0.0, help="share of connections closed mid-answer")
    faults.add_argument("--token-delay-s", type=float, default=0.0, help="extra seconds per token")
    faults.add_argument("--pull-fail-rate", type=float, default=0.0, help="share of KV pulls that fail")
    faults.add_argument(
        "--logprob-noise",
        type=float,
        default=0.0,
        help="add uniform noise of this size to every reported logprob, as bf16 kernels do",
    )
    faults.add_argument("--fault-seed", type=int, default=0)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def _specs(args: argparse.Namespace) -> list[SimInstanceSpec]:
    counts: tuple[tuple[SimRole, int], ...] = (
        ("prefill", args.prefill),
        ("decode", args.decode),
        ("both", args.both),
    )
    roles = [role for role, count in counts for _ in range(count)]
    if not roles:
        raise ConfigError("no instances: give --prefill, --decode or --both a positive count")
    if min(args.prefill, args.decode, args.both) < 0:
        raise ConfigError("instance counts must be >= 0")
    if args.first_port == 0:
        return [SimInstanceSpec(role, args.host, 0) for role in roles]
    if not 0 < args.first_port <= 65535 - len(roles) + 1:
        raise ConfigError(f"--first-port {args.first_port} leaves no room for {len(roles)} ports")
    return [SimInstanceSpec(role, args.host, args.first_port + i) for i, role in enumerate(roles)]


def _announce(instances: list[SimInstance]) -> None:
    for inst in instances:
        print(f"{inst.role} {inst.url} engine_id={inst.engine_id}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        specs = _specs(args)
        profile = load_profile(args.profile)
        overrides = {
            "served_model_name": args.served_model_name,
            "max_model_len": args.max_model_len,
            "kv_lease_s": args.kv_lease_s,
            "tensor_parallel_size": args.tensor_parallel_size,
            "prompt_tokens_details": args.enable_prompt_tokens_details or None,
        }
        profile = dataclasses.replace(profile, **{k: v for k, v in overrides.items() if v is not None})
        faults = FaultSpec(
            error_rate=args.fail_rate, hang_rate=args.hang_rate, drop_rate=args.drop_rate,
            token_delay_s=args.token_delay_s, pull_fail_rate=args.pull_fail_rate, seed=args.fault_seed,
            logprob_noise=args.logprob_noise,
        )  # fmt: skip
    except ConfigError as exc:
        print(f"pdserve sim: {exc}", file=sys.stderr)
        return 2
    try:
        run_sim(specs, profile, faults, args.log_level, on_ready=_announce)
    except OSError as exc:  # typically a port in use
        print(f"pdserve sim: {exc}", file=sys.stderr)
        return 1
    return 0
