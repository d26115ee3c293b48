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
"""

from __future__ import annotations

import random
import sys
import threading
import uuid
from typing import Any

from _common import print_result, script_parser
from pdserve import httpclient, kvproof, protocol
from pdserve.commands.verify import verify
from pdserve.errors import Unreachable


def _model(url: str) -> str:
    return str(httpclient.get(f"{url}/v1/models", 10).json()["data"][0]["id"])


def _ids(url: str, model: str, num_tokens: int) -> list[int]:
    """A prompt of exactly ``num_tokens`` ids, unique from its first text token (vLLM's /tokenize; the
    simulator has none, and takes any ids)."""
    words = " ".join(
        random.choice(("river", "mill", "boat", "stone", "field", "lamp")) for _ in range(num_tokens)
    )
    text = f"kv proof {uuid.uuid4().hex}: {words}"
    try:
        response = httpclient.post_json(f"{url}/tokenize", {"model": model, "prompt": text}, 30)
        tokens = response.json().get("tokens") if response.status == 200 else None
    except Unreachable:
        tokens = None
    if not tokens:
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
    """Decode ``ids`` with the params prefill gives for ``params_of`` (default: ``ids`` itself)."""
    body = {"model": model, "prompt": ids, "max_tokens": 32, "temperature": 0.0}
    prefilled = body if params_of is None else {**body, "prompt": params_of}
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
    p.add_argument("--proxy", required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--rounds", type=int, default=3, help="healthy and wrong-KV handoffs each, this many")
    a = p.parse_args()
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
