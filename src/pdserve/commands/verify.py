"""`pdserve verify URL`: proof that PD works beyond HTTP 200, per request, beside other traffic.

Through the proxy it sends completions and chat requests, streamed and not, each under its own
X-Request-Id, then checks for each one
1. it answered 200 with text and (streamed) ended with [DONE] and no error event;
2. decode did not compute its prompt: decode's own ``usage.prompt_tokens_details.cached_tokens`` equals
   its ``prompt_tokens`` (the prompt is unique from its first token, so only the connector can have
   supplied it; pdserve.kvproof says why this holds per request where counter deltas cannot);
3. (whole answers) the answer is the one prefill's KV should give: one decode instance, no PD, scores
   the answer's tokens teacher-forced and their logprobs agree within the stated tolerance; in float32
   the text must also equal that instance's own greedy answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve import httpclient, kvproof, sse
from pdserve.engines.transfers import TransferCounts, transfer_counts
from pdserve.errors import Unreachable, VerifyError
from pdserve.kvproof import Evidence, Tolerance

_MAX_TOKENS = 16
_COUNTER_WAIT = 30.0  # vLLM publishes connector stats with engine steps; they lag the answer a little


@dataclass(frozen=True)
class Answer:
    status: int
    text: str
    error: str | None = None  # an error body or streamed error event, if any
    request_id: str | None = None
    evidence: Evidence = field(default_factory=Evidence)


@dataclass
class Report:
    checks: list[tuple[bool, str]] = field(default_factory=list)
    answers: list[tuple[str, Answer]] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> bool:
        self.checks.append((ok, what))
        return ok

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(ok for ok, _ in self.checks)

    def lines(self) -> list[str]:
        return [f"  {'PASS' if ok else 'FAIL'}  {what}" for ok, what in self.checks]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    """GET (body None) or POST JSON; (status, parsed JSON or text). VerifyError when unreachable."""
    try:
        response = httpclient.get(url, timeout) if body is None else httpclient.post_json(url, body, timeout)
    except Unreachable as exc:
        raise VerifyError(str(exc)) from exc
    return response.status, response.json()


def _text_of(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    part = choice.get("message") or choice.get("delta") or {}
    return str(part.get("content") or "")


def ask(
    base: str, path: str, body: dict[str, Any], timeout: float = 120.0, request_id: str | None = None
) -> Answer:
    """One request; a streamed one is read to the end, its deltas joined and its events checked."""
    headers = {"X-Request-Id": request_id} if request_id else None
    try:
        response = httpclient.post_json(base + path, body, timeout, headers=headers)
    except Unreachable as exc:
        raise VerifyError(str(exc)) from exc
    request_id = response.headers.get("x-request-id")
    if response.status != 200:
        return Answer(response.status, "", error=response.body.decode("utf-8", "replace"))
    if not body.get("stream"):
        data = json.loads(response.body)
        return Answer(
            response.status,
            _text_of(data["choices"][0]),
            request_id=request_id,
            evidence=kvproof.evidence_of([data]),
        )
    return _read_stream(response.status, response.body, request_id)


def _read_stream(status: int, raw: bytes, request_id: str | None) -> Answer:
    parts: list[str] = []
    chunks: list[dict[str, Any]] = []
    is_done = False
    for payload in sse.payloads(raw):
        if payload == sse.DONE_PAYLOAD:
            is_done = True
            continue
        error = sse.error_of(payload)
        if error is not None:
            return Answer(status, "".join(parts), error=json.dumps(error), request_id=request_id)
        chunk = json.loads(payload)
        chunks.append(chunk)
        parts.extend(_text_of(c) for c in chunk.get("choices", []))
    cut = None if is_done else "stream ended without [DONE]"
    return Answer(status, "".join(parts), cut, request_id, kvproof.evidence_of(chunks))


def cases(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body): each prompt unique, so no earlier run's prefix cache stands in for a pull."""
    nonce = uuid.uuid4().hex[:8]
    common = {"model": model, "max_tokens": _MAX_TOKENS, "temperature": 0.0}
    out: list[tuple[str, str, dict[str, Any]]] = []
    for stream in (False, True):
        kind = "streamed" if stream else "non-streamed"
        prompt = f"Verify {nonce} {kind}: the river carried the small boat past the mill and"
        out.append(
            (f"completions, {kind}", "/v1/completions", {**common, "prompt": prompt, "stream": stream})
        )
        messages = [{"role": "user", "content": f"Verify {nonce} {kind}: tell me about the old mill."}]
        out.append(
            (f"chat, {kind}", "/v1/chat/completions", {**common, "messages": messages, "stream": stream})
        )
    return out


def wait_for_transfers(
    decode_urls: list[str], before: TransferCounts, expected: int, timeout: float = _COUNTER_WAIT
) -> TransferCounts:
    """Counter delta once it reaches ``expected`` (or at ``timeout``), re-read once more to catch extras.
    For tests on an otherwise idle system; verify itself proves each request's transfer on its own."""
    deadline = time.monotonic() + timeout
    delta = transfer_counts(decode_urls) - before
    while delta.successful < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        delta = transfer_counts(decode_urls) - before
    time.sleep(1.0)
    return transfer_counts(decode_urls) - before


def check_answer(
    report: Report,
    label: str,
    answer: Answer,
    reference_url: str,
    model: str,
    tolerance: Tolerance,
    alone: Answer | None = None,
) -> None:
    """The per-request checks of one PD answer; each names the request, so a failure says which."""
    who = f"{label} [{answer.request_id}]"
    is_answered = report.check(
        answer.status == 200 and answer.error is None and bool(answer.text),
        f"{who}: HTTP {answer.status}, {len(answer.text)} chars"
        + (f", error {answer.error}" if answer.error else ""),
    )
    if not is_answered:
        return
    ok, said = answer.evidence.transfer()
    report.check(ok, f"{who}: {said}")
    if alone is None:  # a stream: its tokens' logprobs are checked on the whole answers
        return
    agreement = kvproof.teacher_forced(reference_url, model, answer.evidence)
    report.check(
        agreement.within(tolerance),
        f"{who}: its logprobs agree with one instance scoring the same tokens, no PD "
        f"({agreement.says()}; tolerance {tolerance.describe()})",
    )
    if tolerance.exact_text:
        report.check(
            alone.status == 200 and alone.text == answer.text,
            f"{who}: same greedy text as one instance alone"
            + ("" if alone.text == answer.text else f" (PD {answer.text!r} vs alone {alone.text!r})"),
        )


def verify(proxy_url: str, say: Callable[[str], None] = print, tolerance: Tolerance = kvproof.BF16) -> Report:
    proxy_url = proxy_url.rstrip("/")
    report = Report()
    status, instances = http_json(f"{proxy_url}/instances", timeout=10)
    if status != 200 or not isinstance(instances, list):
        raise VerifyError(f"{proxy_url}/instances answered {status}: is this a pdserve proxy?")
    decode_urls = [i["url"] for i in instances if i["role"] == "decode"]
    num_prefill = len(instances) - len(decode_urls)
    # With no instance of a role there is nothing to prove PD with: that is a failed check, not a pass.
    report.check(num_prefill > 0, f"the proxy lists {num_prefill} prefill instance(s)")
    report.check(bool(decode_urls), f"the proxy lists {len(decode_urls)} decode instance(s)")
    for inst in instances:
        report.check(inst["healthy"], f"{inst['role']} instance {inst['url']} is healthy")
    if not report.ok:
        return report
    status, models = http_json(f"{proxy_url}/v1/models", timeout=10)
    if not report.check(status == 200, f"/v1/models answered {status}"):
        return report
    model = models["data"][0]["id"]
    say(f"model {model}; {num_prefill} prefill, {len(decode_urls)} decode instance(s)")
    say(f"answer oracle: teacher-forced logprobs, tolerance {tolerance.describe()}")

    nonce = uuid.uuid4().hex[:8]
    for i, (label, path, body) in enumerate(cases(model)):
        endpoint = "chat" if "chat" in path else "completions"
        answer = ask(proxy_url, path, kvproof.with_evidence(body, endpoint), request_id=f"verify-{nonce}-{i}")
        report.answers.append((label, answer))
        alone = None
        if not body.get("stream"):
            alone = ask(decode_urls[0], path, {**body, "cache_salt": f"pdserve-alone-{nonce}-{i}"})
        check_answer(report, label, answer, decode_urls[0], model, tolerance, alone)
    return report
