"""`pdserve sim calibrate URL`: fit a sim Profile's step costs from a running vLLM instance.

Streamed completions at temperature 0 with ``ignore_eos``, so lengths are exact:

- prefill: lone requests of 16..1024 prompt tokens, one output token; median TTFT per length is fitted as
  ``overhead + prefill_per_token_s · prompt_tokens``.
- decode: B = 1, 2, 4, 8 concurrent requests, short and long prompts, 32 output tokens. Only tokens that
  arrive while all B decode count; the median per-token time is fitted as
  ``step_base_s + decode_per_seq_s · B + decode_per_ctx_token_s · B · context``.

The TTFT intercept also holds HTTP, API-server and scheduling overhead, so ``step_base_s`` is the decode
fit's. Prompts are fresh random token ids, so the prefix cache never hides prefill work. Block size, KV
blocks, context and model name are read from the server (probe.py talks to it); the rest is given with
``--set KEY=VALUE``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import functools
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdserve.errors import CalibrationError, PDServeError
from pdserve.sim.fit import Fit, least_squares, quantile
from pdserve.sim.probe import Probe, Sample, open_probe
from pdserve.sim.profile import Profile, profile_from_mapping

_say = functools.partial(print, file=sys.stderr, flush=True)  # progress and warnings; stdout may be the YAML
_MIN_STEP_S = 2e-4  # no vLLM step is this fast: a stream showing it was buffered and delivered in a burst


@dataclass(frozen=True)
class Plan:
    prefill_lengths: tuple[int, ...]  # prompt tokens of the lone prefill requests
    prefill_repeats: int
    batch_sizes: tuple[int, ...]
    decode_prompt_lengths: tuple[int, ...]
    decode_repeats: int
    decode_output_tokens: int
    quantile: float = 0.5  # of each group's samples; the median, or lower on a machine others load


# Prompts up to 4k where the model takes them (shorter ones are dropped): on a GPU with CUDA graphs a prompt
# under ~500 tokens costs the step's floor whatever its length, so short prompts alone would flatten the
# per-token slope (on one H200, 18 us/token fitted from 16-1024 tokens against 24 us from 512-1024).
FULL_PLAN = Plan((16, 64, 128, 256, 512, 768, 1024, 2048, 4096), 9, (1, 2, 4, 8), (16, 512, 1536), 8, 32)
QUICK_PLAN = Plan((16, 256, 1024), 3, (1, 4, 8), (16, 1024), 2, 32)


@dataclass(frozen=True)
class Point:
    """One group's statistic (median TTFT or per-token time) and the design-matrix row it is fitted against."""

    row: tuple[float, ...]
    y: float
    label: str  # for the YAML comment table


def _time_per_token(chunks: Sequence[tuple[float, int]]) -> float:
    tokens = sum(num for _, num in chunks[1:])
    return (chunks[-1][0] - chunks[0][0]) / tokens if tokens else 0.0


def steady_decode(batch: Sequence[Sample]) -> list[tuple[float, float]]:
    """(seconds per token, mean context) of each request while the whole batch was decoding.

    Per request the rate is tokens over elapsed time inside the window rather than a median of chunk gaps:
    a busy API server delivers a stream's chunks in bursts, which leaves its gaps long-short-long. A stream
    that arrived in one burst tells nothing about steps; it neither bounds the window nor yields a rate.
    """
    streams = [s for s in batch if _time_per_token(s.chunks) >= _MIN_STEP_S]
    if not streams:
        return []
    start = max(s.chunks[0][0] for s in streams)  # the last request has its first token
    end = min(s.chunks[-1][0] for s in streams)  # no request has finished yet
    out: list[tuple[float, float]] = []
    for s in streams:
        inside = [(at, num) for at, num in s.chunks if start <= at <= end]
        if _time_per_token(inside) >= _MIN_STEP_S:
            before = sum(num for at, num in s.chunks if at < start)  # tokens generated before the window
            tokens = sum(num for _, num in inside[1:])
            out.append((_time_per_token(inside), s.prompt_tokens + before + inside[0][1] + tokens / 2))
    return out


async def measure(
    server: Probe, model: str, plan: Plan, max_len: int, seed: int
) -> tuple[list[Point], list[Point]]:
    """Run both experiments; returns the prefill points (TTFT) and the decode points (per-token interval)."""
    rng = random.Random(seed)
    pool = await server.token_pool(model)

    def prompt(n: int) -> list[int]:
        return rng.choices(pool, k=n)

    out_tokens = plan.decode_output_tokens
    prefill_lengths = [n for n in plan.prefill_lengths if n < max_len - 1]
    decode_lengths = [n for n in plan.decode_prompt_lengths if n + out_tokens < max_len]
    _say("warming up")
    await server.complete(model, prompt(max(prefill_lengths)), 1)
    await asyncio.gather(*(server.complete(model, prompt(16), 8) for _ in range(max(plan.batch_sizes))))

    order = [n for n in prefill_lengths for _ in range(plan.prefill_repeats)]
    rng.shuffle(order)  # background load drifting over time must not tilt the slope
    ttfts: dict[int, list[float]] = {}
    _say(f"prefill: {len(order)} lone requests")
    for n in order:
        sample = await server.complete(model, prompt(n), 1)
        ttfts.setdefault(sample.prompt_tokens, []).append(sample.chunks[0][0] - sample.sent_at)
    prefill = [
        Point((1.0, float(n)), quantile(v, plan.quantile), f"{n} tokens, {len(v)} requests")
        for n, v in sorted(ttfts.items())
    ]

    # Small batches get more rounds so every group has about as many request samples to take a median of.
    repeats = {b: max(plan.decode_repeats, 16 // b) for b in plan.batch_sizes}
    rounds = [(b, n) for b in plan.batch_sizes for n in decode_lengths for _ in range(repeats[b])]
    rng.shuffle(rounds)
    groups: dict[tuple[int, int], list[tuple[float, float]]] = {}
    _say(f"decode: {len(rounds)} batches of up to {max(plan.batch_sizes)} requests")
    for b, n in rounds:
        batch = await asyncio.gather(*(server.complete(model, prompt(n), out_tokens) for _ in range(b)))
        groups.setdefault((b, n), []).extend(steady_decode(batch))
    decode = []
    for (b, n), rates in sorted(groups.items()):
        if not rates:
            _say(f"warning: no steady decode window for B={b}, prompt {n}; group dropped")
            continue
        ctx = statistics.fmean(c for _, c in rates)
        label = f"B={b}, prompt {n}, ctx {ctx:.0f}, {len(rates)} requests"
        decode.append(Point((1.0, float(b), b * ctx), quantile([r for r, _ in rates], plan.quantile), label))
    return prefill, decode


def fit_points(points: Sequence[Point], what: str) -> Fit:
    try:
        return least_squares([p.row for p in points], [p.y for p in points])
    except ValueError as exc:
        raise CalibrationError(f"cannot fit the {what} data: {exc}") from exc


def clamp(name: str, value: float) -> float:
    if value < 0:
        _say(f"warning: fitted {name} = {value:.3g} < 0 (noise swamps it); using 0")
        return 0.0
    return value


@dataclass(frozen=True)
class Measurement:
    url: str
    version: str  # vLLM's /version
    found: dict[str, Any]  # profile fields read from the server
    http_rtt_s: float  # median GET /health round trip: the floor under every TTFT
    quantile: float  # the statistic taken of each group's samples
    prefill: list[Point]
    decode: list[Point]
    elapsed_s: float


async def measure_server(url: str, plan: Plan, seed: int) -> Measurement:
    async with open_probe(url) as server:
        found = await server.discover()
        version = str(json.loads(await server.call("GET", "/version")).get("version", "?"))
        rtts = []
        for _ in range(5):
            sent = time.perf_counter()
            await server.call("GET", "/health")
            rtts.append(time.perf_counter() - sent)
        started = time.monotonic()
        max_len = int(found.get("max_model_len", 2048))
        prefill, decode = await measure(server, found["served_model_name"], plan, max_len, seed)
        elapsed = time.monotonic() - started
    return Measurement(url, version, found, statistics.median(rtts), plan.quantile, prefill, decode, elapsed)


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(Profile)} - {"name"}
    sets: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key.strip() not in fields:
            raise CalibrationError(f"--set wants KEY=VALUE, KEY one of {', '.join(sorted(fields))}: {item!r}")
        try:
            sets[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise CalibrationError(f"--set {item!r}: the value is not YAML ({exc})") from None
    return sets


def _table(points: Sequence[Point], fit: Fit) -> list[str]:
    return [
        f"#   {p.label}: measured {p.y * 1e3:.3f} ms, fit {fit.predict(p.row) * 1e3:.3f} ms" for p in points
    ]


def profile_yaml(m: Measurement, sets: dict[str, Any], command: str, today: str) -> str:
    """Fit the measurement and render the profile: a comment header with the evidence, then every field
    with where its value came from. The result is validated as a Profile before it is returned."""
    prefill_fit, decode_fit = fit_points(m.prefill, "prefill"), fit_points(m.decode, "decode")
    overhead, per_token = prefill_fit.coefficients
    base, per_seq, per_ctx = decode_fit.coefficients
    fitted = {"step_base_s": base, "prefill_per_token_s": per_token}
    fitted |= {"decode_per_seq_s": per_seq, "decode_per_ctx_token_s": per_ctx}
    # What the TTFT intercept holds beyond one engine step and the HTTP round trip: vLLM's per-request
    # work outside the engine (API server, tokenization, IPC). The sim adds it before admission.
    fitted["request_overhead_s"] = overhead - base - m.http_rtt_s
    model = m.found.get("served_model_name", "?")
    prefill_q = f"prefill R²={prefill_fit.r_squared:.3f} rmse={prefill_fit.rmse * 1e3:.2f}ms"
    decode_q = f"decode R²={decode_fit.r_squared:.3f} rmse={decode_fit.rmse * 1e3:.3f}ms"
    values: dict[str, Any] = {
        "source": f"measured {today} on vLLM {m.version} at {m.url} (model {model}) by `{command}`; "
        f"{prefill_q}; {decode_q}",
        **{k: float(f"{clamp(k, v):.4g}") for k, v in fitted.items()},
        **m.found,
        **sets,
    }
    origins = dict.fromkeys(fitted, "fitted") | dict.fromkeys(m.found, "read from the server")
    origins |= dict.fromkeys(sets, "--set")
    for name in ("max_num_seqs", "max_num_batched_tokens", "kv_pull_base_s", "kv_pull_per_block_s"):
        if name not in values:
            _say(f"warning: vLLM does not expose {name}; the Profile default stays (give it with --set)")
    profile_from_mapping(values)
    stat = "median" if m.quantile == 0.5 else f"{m.quantile:g}-quantile"
    lines = [
        f"# Calibrated {today} by: {command}",
        f"# Server: vLLM {m.version} at {m.url}, model {model}; measuring took {m.elapsed_s:.0f} s.",
        f"# Prefill, lone requests with 1 output token: {stat} TTFT = {overhead * 1e3:.3f} ms "
        f"+ {per_token * 1e6:.3f} us/token ({prefill_q}).",
        f"# The intercept is HTTP (GET /health took {m.http_rtt_s * 1e3:.2f} ms), API-server and scheduling "
        "overhead plus one step base; step_base_s is the decode fit's.",
        *_table(m.prefill, prefill_fit),
        f"# Decode, {stat} per-token time while all B requests decode = {base * 1e3:.3f} ms + {per_seq * 1e3:.4f} ms·B "
        f"+ {per_ctx * 1e9:.3f} ns·(B·context) ({decode_q}).",
        *_table(m.decode, decode_fit),
    ]
    for f in dataclasses.fields(Profile):
        if f.name == "name":
            continue  # load_profile names a profile after its file
        text = yaml.safe_dump({f.name: values.get(f.name, f.default)}, width=10_000, allow_unicode=True)
        lines.append(
            text.strip() if f.name == "source" else f"{text.strip()}  # {origins.get(f.name, 'default')}"
        )
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="base URL of a running vLLM server")
    parser.add_argument("--out", type=Path, help="write the profile YAML here (default: stdout)")
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repeats (about 10 s)")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="a profile field vLLM does not expose (repeatable), e.g. max_num_seqs=128",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--quantile", type=float, default=0.5, help="of repeated samples: 0.5 is the median")


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    command = "pdserve sim calibrate " + shlex.join(argv) if argv else "pdserve sim calibrate " + args.url
    if not 0.0 <= args.quantile <= 1.0:
        raise CalibrationError(f"--quantile must be within [0, 1], got {args.quantile}")
    plan = dataclasses.replace(QUICK_PLAN if args.quick else FULL_PLAN, quantile=args.quantile)
    sets = parse_sets(args.sets)
    measurement = asyncio.run(measure_server(args.url, plan, args.seed))
    text = profile_yaml(measurement, sets, command, datetime.date.today().isoformat())
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            args.out.write_text(text)
        except OSError as exc:
            raise CalibrationError(f"cannot write {args.out}: {exc}") from exc
        _say(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="pdserve sim calibrate", description="Fit a sim profile from a running vLLM instance."
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args, argv)
    except PDServeError as exc:
        print(f"pdserve sim calibrate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
