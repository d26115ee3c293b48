"""pdserve's per-request KV proof against a running pair: the wrong-KV injection and verify under load.

  wrong KV   two prompts of the same length, fresh from their first token, prefilled on PREFILL; DECODE is
             handed its own prompt with the params of the other. Every counter and its cached-token count
             say the KV came over; only the teacher-forced oracle (pdserve.kvproof) can catch it, and it
             must, at the bf16 tolerance used on GPUs. A healthy handoff of a third prompt must pass.
  verify     `pdserve verify PROXY` while ``--streams`` other clients stream unique prompts through the same
             proxy: each of verify's requests must prove its own transfer beside their traffic.

    python benchmarks/kv_proof.py --proxy http://127.0.0.1:8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8101 --streams 16

Prints the figures and a RESULT line; exits 1 when a check fails. gpu_run.py runs the same as its
``proof`` step.

With ``--calibrate`` it measures what the bf16 tolerance rests on instead (gpu_run.py's ``tolerance``
step), each request under its own fresh ``cache_salt``, ``--parallel`` at a time in a shuffled order so
every kind sees the same batches:

  healthy    ``--healthy`` fresh prompts handed off PREFILL -> DECODE, scored teacher-forced on DECODE
  alone      as many fresh prompts served whole by DECODE and scored by DECODE: one instance against itself
  wrong      ``--wrong`` handoffs of each kind in ``--kinds`` (``CLOSEST``): decode is handed
             the params of a fresh prompt of the same length that differs from its own only in the last
             block, only in the first block, only in one token, or everywhere (``other``)

    python benchmarks/kv_proof.py --calibrate --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8101
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from _common import add_numbers, print_result, script_parser
from pdserve import httpclient, kvproof, protocol
from pdserve.commands.verify import verify
from pdserve.errors import MetricsUnreadable, Unreachable
from pdserve.prometheus import CACHE_CONFIG_INFO, labels_of, scrape_text


def _model(url: str) -> str:
    return str(httpclient.get(f"{url}/v1/models", 10).json()["data"][0]["id"])


def _ids(url: str, model: str, num_tokens: int) -> list[int]:
    """A prompt of exactly ``num_tokens`` ids, fresh from its first token to its last (kvproof.fresh_text,
    each word at least one token, through vLLM's /tokenize; the simulator has none, and takes any ids)."""
    text = kvproof.fresh_text(num_tokens, "kv proof")
    try:
        response = httpclient.post_json(f"{url}/tokenize", {"model": model, "prompt": text}, 30)
        tokens = response.json().get("tokens") if response.status == 200 else None
    except Unreachable:
        tokens = None
    if not tokens or len(tokens) < num_tokens:
        return [random.randrange(100, 900) for _ in range(num_tokens)]
    return list(tokens[:num_tokens])


def _completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpclient.post_json(f"{url}/v1/completions", body, 300)
    if response.status != 200:
        raise RuntimeError(f"{url}: HTTP {response.status}: {response.body[:300]!r}")
    data = response.json()
    assert isinstance(data, dict)
    return data


def handoff(
    prefill: str, decode: str, model: str, ids: list[int], params_of: list[int] | None = None
) -> kvproof.Evidence:
    """Decode ``ids`` with the params prefill gives for ``params_of`` (default: ``ids`` itself), each
    prompt under its own fresh salt (so neither instance holds a prefix of either)."""
    body = {"model": model, "prompt": ids, "max_tokens": kvproof.MIN_ANSWER_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "cache_salt": kvproof.fresh_salt("proof")}  # fmt: skip
    prefilled = (
        body
        if params_of is None
        else {**body, "prompt": params_of, "cache_salt": kvproof.fresh_salt("other")}
    )
    params = _completion(prefill, protocol.prefill_body(prefilled))["kv_transfer_params"]
    answer = _completion(decode, kvproof.with_evidence(protocol.decode_body(body, params), "completions"))
    return kvproof.evidence_of([answer])


def wrong_kv(prefill: str, decode: str, num_tokens: int, rounds: int) -> dict[str, Any]:
    model = _model(decode)
    out: dict[str, Any] = {"tolerance": kvproof.BF16.describe(), "healthy": [], "wrong": []}
    for _ in range(rounds):
        for kind, other in (("healthy", None), ("wrong", _ids(decode, model, num_tokens))):
            evidence = handoff(prefill, decode, model, _ids(decode, model, num_tokens), other)
            agreement = kvproof.teacher_forced(decode, model, evidence)
            out[kind].append(
                {
                    "transfer": evidence.transfer()[1],
                    "oracle": agreement.says(),
                    "within": agreement.within(kvproof.BF16),
                }
            )
    out["ok"] = all(r["within"] for r in out["healthy"]) and not any(r["within"] for r in out["wrong"])
    return out


# The closest wrong KV: where the prompt whose params decode is handed differs from decode's own prompt
# (of ``n`` tokens, in blocks of ``block``), and nowhere else.
CLOSEST: Final[dict[str, Callable[[int, int, random.Random], range]]] = {
    "last-block": lambda n, block, _rng: range(n - block, n),
    "first-block": lambda _n, block, _rng: range(block),
    "one-token": lambda n, block, rng: range(at := rng.randrange(block, n - block), at + 1),
    "other": lambda n, _block, _rng: range(n),
}


def closest(kind: str, ids: list[int], other: list[int], block: int, rng: random.Random) -> list[int]:
    """``ids`` with the tokens ``kind`` names taken from ``other`` (a fresh prompt of the same length), each
    one different from the token it replaces."""
    out = list(ids)
    for at in CLOSEST[kind](len(ids), block, rng):
        out[at] = next(t for t in (*other[at:], *other[:at]) if t != ids[at])
    return out


def block_size(url: str, default: int = 16) -> int:
    """The engine's KV block size from its ``vllm:cache_config_info``; ``default`` (a GPU's) if unreadable."""
    try:
        value = (labels_of(scrape_text(url, 5), CACHE_CONFIG_INFO) or {}).get("block_size", "")
    except (MetricsUnreadable, Unreachable):
        value = ""
    return int(value) if value.isdigit() else default


def calibrate_one(
    prefill: str, decode: str, model: str, kind: str, num_tokens: int, block: int
) -> dict[str, Any]:
    """One sample: a fresh prompt handed off (healthy), served whole (alone) or decoded with the params of
    its ``kind`` of closest other prompt; scored teacher-forced on DECODE."""
    rng = random.Random(uuid.uuid4().int)
    ids = _ids(decode, model, num_tokens)
    if kind == "alone":
        body = {"model": model, "prompt": ids, "max_tokens": kvproof.MIN_ANSWER_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "cache_salt": kvproof.fresh_salt("alone")}  # fmt: skip
        evidence = kvproof.evidence_of([_completion(decode, kvproof.with_evidence(body, "completions"))])
    else:
        other = None if kind == "healthy" else closest(kind, ids, _ids(decode, model, num_tokens), block, rng)
        evidence = handoff(prefill, decode, model, ids, other)
    agreement = kvproof.teacher_forced(decode, model, evidence)
    return {
        "kind": kind,
        "prompt_tokens": num_tokens,
        "transfer": evidence.transfer()[0] if kind != "alone" else None,
        "problem": agreement.problem,
        "mean": agreement.mean,
        "max": agreement.worst,
        "deltas": [round(d, 5) for d in agreement.deltas],
    }


def calibrate(
    prefill: str,
    decode: str,
    *,
    healthy: int,
    wrong: int,
    kinds: list[str],
    parallel: int,
    tokens: tuple[int, int],
    say: Callable[[str], None] = print,
    deadline: float = math.inf,
) -> dict[str, Any]:
    """Every sample of every kind, in a shuffled order ``parallel`` at a time; per kind a summary. Samples
    not started by ``deadline`` (time.monotonic) are left out, and counted as such."""
    model = _model(decode)
    block = block_size(decode)
    lo, hi = (max(t // block, kvproof.MIN_PROMPT_BLOCKS) for t in tokens)
    plan = [k for k in ("healthy", "alone") for _ in range(healthy)] + [
        k for k in kinds for _ in range(wrong)
    ]
    random.shuffle(plan)  # every kind meets the same batches and the same GPU warmth
    say(
        f"calibrate: {len(plan)} samples on {model}, block {block}, prompts of {lo}-{hi} blocks, {parallel} at a time"
    )

    def one(kind: str) -> dict[str, Any] | None:
        if time.monotonic() > deadline:
            return None
        try:
            return calibrate_one(prefill, decode, model, kind, random.randint(lo, hi) * block, block)
        except (RuntimeError, Unreachable) as exc:
            return {"kind": kind, "problem": str(exc)[:300], "mean": None, "max": None, "deltas": []}

    with ThreadPoolExecutor(parallel) as pool:
        rows = [r for r in pool.map(one, plan) if r is not None]
    if len(rows) < len(plan):
        say(f"calibrate: out of time, {len(plan) - len(rows)} of {len(plan)} samples not run")
    summary = {k: summarize([r for r in rows if r["kind"] == k]) for k in ("healthy", "alone", *kinds)}
    for kind, figures in summary.items():
        say(f"  {kind:12} {figures['line']}")
    return {"model": model, "block_size": block, "parallel": parallel, "prompt_tokens": [lo * block, hi * block],
            "planned": len(plan), "tolerance": kvproof.BF16.describe(), "summary": summary, "rows": rows}  # fmt: skip


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"min": ordered[0], "p50": statistics.median(ordered), "p99": p99, "max": ordered[-1]}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-request mean Δ and max Δ over the samples of one kind, and how many the bf16 bounds pass."""
    scored = [r for r in rows if r["problem"] is None]
    out: dict[str, Any] = {
        "n": len(rows),
        "scored": len(scored),
        "problems": sorted({str(r["problem"]) for r in rows} - {"None"})[:5],
    }
    if not scored:
        out["line"] = f"n {len(rows)}, none scored: {out['problems'][:1]}"
        return out
    out["mean"] = _quantiles([r["mean"] for r in scored])
    out["max"] = _quantiles([r["max"] for r in scored])
    bf16 = kvproof.BF16
    out["within_bf16"] = sum(r["mean"] <= bf16.max_mean and r["max"] <= bf16.max_any for r in scored)
    out["transferred"] = sum(bool(r.get("transfer")) for r in scored)
    m, x = out["mean"], out["max"]
    out["line"] = (
        f"n {len(scored)}/{len(rows)}: mean Δ min {m['min']:.3g} p50 {m['p50']:.3g} p99 {m['p99']:.3g} "
        f"max {m['max']:.3g}; max Δ p50 {x['p50']:.3g} p99 {x['p99']:.3g} max {x['max']:.3g}; "
        f"within bf16 {out['within_bf16']}/{len(scored)}"
    )
    return out


def verify_under_load(proxy: str, streams: int, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    model = _model(proxy)
    stop = threading.Event()
    counts = {"sent": 0, "failed": 0}

    def client() -> None:
        while not stop.is_set():
            prompt = f"load {uuid.uuid4().hex} " + "the river carried the boat " * (prompt_tokens // 6)
            body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "stream": True}
            try:
                status = httpclient.post_json(f"{proxy}/v1/completions", body, 300).status
            except Unreachable:
                status = 0
            counts["sent"] += 1
            counts["failed"] += status != 200

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    try:
        report = verify(proxy, say=lambda _line: None, tolerance=kvproof.BF16)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    return {"ok": report.ok, "lines": report.lines(), "streams": streams, **counts}


def main() -> int:
    p = script_parser(__doc__, {"--streams": 16, "--prompt-tokens": 2000, "--output-tokens": 128})
    p.add_argument("--proxy", help="the PD proxy (not needed with --calibrate)")
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--rounds", type=int, default=3, help="healthy and wrong-KV handoffs each, this many")
    p.add_argument("--calibrate", action="store_true", help="measure the bf16 tolerance's figures instead")
    p.add_argument(
        "--kinds", default=",".join(CLOSEST), help=f"wrong-KV kinds for --calibrate: {', '.join(CLOSEST)}"
    )
    add_numbers(
        p, {"--healthy": 100, "--wrong": 50, "--parallel": 8, "--min-tokens": 256, "--max-tokens": 1024}
    )
    a = p.parse_args()
    if a.calibrate:
        kinds = [k for k in a.kinds.split(",") if k]
        if unknown := set(kinds) - set(CLOSEST):
            p.error(f"unknown --kinds {sorted(unknown)}; known: {', '.join(CLOSEST)}")
        figures = calibrate(a.prefill, a.decode, healthy=a.healthy, wrong=a.wrong, kinds=kinds,
                            parallel=a.parallel, tokens=(a.min_tokens, a.max_tokens))  # fmt: skip
        print_result(figures)
        return 0
    if not a.proxy:
        p.error("--proxy is needed (unless --calibrate)")
    result = {
        "wrong_kv": wrong_kv(a.prefill, a.decode, 300, a.rounds),
        "verify": verify_under_load(a.proxy, a.streams, a.prompt_tokens, a.output_tokens),
    }
    for kind in ("healthy", "wrong"):
        for r in result["wrong_kv"][kind]:
            print(f"{kind:8} {r['transfer']}; {r['oracle']}; within {'yes' if r['within'] else 'no'}")
    print("\n".join(result["verify"]["lines"]))
    print_result(result)
    return 0 if result["wrong_kv"]["ok"] and result["verify"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
