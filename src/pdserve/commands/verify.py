"""`pdserve verify URL`: proof that PD works beyond HTTP 200, per request, beside other traffic, through
the proxy alone if need be.

Through the proxy it sends completions and chat requests, streamed and not, each under its own
X-Request-Id and its own fresh ``cache_salt``, each prompt fresh from its first word to its last and at
least ``kvproof.MIN_PROMPT_BLOCKS`` KV blocks long, then checks for each one
1. it answered 200 with text and (streamed) ended with [DONE] and no error event;
2. the proxy split it (its /requests record), so there is a transfer to prove: an elastic pool or a
   ``--skip-prefill-below`` proxy serves short prompts whole, so a request kept whole is sent again,
   longer, and a pool that keeps even that whole is reported as one verify cannot prove;
3. decode did not compute its prompt: decode's own ``usage.prompt_tokens_details.cached_tokens`` equals
   its ``prompt_tokens`` (the salt leaves decode no local prefix, so only the connector can have
   supplied it; pdserve.kvproof says why this holds per request where counter deltas cannot);
4. the answer is the one prefill's KV should give: one instance, no PD, scores at least
   ``kvproof.MIN_ANSWER_TOKENS`` of the answer's tokens teacher-forced (a stream's too) and their
   logprobs agree within the stated tolerance; in float32 a whole answer's text must also equal that
   instance's own greedy answer.
The reference instance is asked directly when verify can reach it, else through the proxy
(``X-Pdserve-Whole-On``, with the admin key where the proxy has one); verify says which.

Under load verify's requests queue behind everyone else's, so it waits for each answer as long as the
instances make progress (pdserve.patience), says when it is queued, and fails only on a stall or past
``--max-wait``. Every request it sends carries an X-Request-Id it names, for /requests and
`pdserve trace`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve import httpclient, kvproof, sse
from pdserve.commands.proofpath import Reference, find_reference, split_of
from pdserve.engines.transfers import TransferCounts, transfer_counts
from pdserve.errors import Unreachable, VerifyError
from pdserve.kvproof import Evidence, Tolerance
from pdserve.patience import Patient, Waiting, proxy_readings

# fresh_text's words are at least a token each in every tokenizer seen, and at most about 4 (pdserve's
# tiny model's byte-level BPE, numbers included: 3.6)
_MAX_TOKENS_PER_WORD = 4
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
    request_ids: list[str] = field(default_factory=list)  # every request verify sent, in order

    def check(self, ok: bool, what: str) -> bool:
        self.checks.append((ok, what))
        return ok

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(ok for ok, _ in self.checks)

    def lines(self) -> list[str]:
        return [f"  {'PASS' if ok else 'FAIL'}  {what}" for ok, what in self.checks]


def http_json(
    url: str,
    body: dict[str, Any] | None = None,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """GET (body None) or POST JSON; (status, parsed JSON or text). VerifyError when unreachable."""
    try:
        if body is None:
            response = httpclient.request(url, timeout=timeout, headers=headers)
        else:
            response = httpclient.post_json(url, body, timeout, headers=headers)
    except Unreachable as exc:
        raise VerifyError(str(exc)) from exc
    return response.status, response.json()


def _text_of(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    part = choice.get("message") or choice.get("delta") or {}
    return str(part.get("content") or "")


def ask(
    base: str,
    path: str,
    body: dict[str, Any],
    timeout: float = 120.0,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
    post: Callable[..., httpclient.Response] = httpclient.post_json,
) -> Answer:
    """One request; a streamed one is read to the end, its deltas joined and its events checked.
    ``post``: as ``httpclient.post_json`` (verify's own waits while the instances make progress)."""
    sent = {**(headers or {}), **({"X-Request-Id": request_id} if request_id else {})}
    try:
        response = post(base + path, body, timeout, headers=sent)
    except Unreachable as exc:
        raise VerifyError(str(exc)) from exc
    request_id = response.headers.get("x-request-id") or request_id
    if response.status != 200:
        return Answer(response.status, "", response.body.decode("utf-8", "replace"), request_id)
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


def cases(model: str, num_words: int = 600) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body): each prompt fresh from its first word to its last and under its own salt,
    so no prefix cache (decode's least of all) stands in for a pull, and no two share KV."""
    common = {"model": model, "max_tokens": kvproof.MIN_ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True}
    out: list[tuple[str, str, dict[str, Any]]] = []
    for stream in (False, True):
        kind = "streamed" if stream else "non-streamed"
        for label, path, key in (
            ("completions", "/v1/completions", "prompt"),
            ("chat", "/v1/chat/completions", "messages"),
        ):
            text = kvproof.fresh_text(num_words, "verify")
            prompt: Any = text if key == "prompt" else [{"role": "user", "content": text}]
            body = {**common, key: prompt, "stream": stream, "cache_salt": kvproof.fresh_salt("verify")}
            out.append((f"{label}, {kind}", path, body))
    return out


def _longer(body: dict[str, Any], factor: int) -> dict[str, Any]:
    """``body`` with a fresh prompt ``factor`` times as long, under a fresh salt."""
    text = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
    words = kvproof.fresh_text(len(text.split()) * factor, "verify")
    prompt = {"prompt": words} if "prompt" in body else {"messages": [{"role": "user", "content": words}]}
    return {**body, **prompt, "cache_salt": kvproof.fresh_salt("verify")}


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
    reference: Reference,
    model: str,
    tolerance: Tolerance,
    alone: Answer | None = None,
    moved: str | None = None,
    post: Callable[..., httpclient.Response] = httpclient.post_json,
    handover: str | None = None,
) -> None:
    """The per-request checks of one PD answer; each names the request, so a failure says which.
    ``moved``: the stream went on from another instance mid-way (the proxy's record says so).
    ``handover``: how the proxy's record says the KV reached decode (pull or push); decode's own
    cached-token count proves the transfer in either mode (in push mode prefill counts the WRITE)."""
    who = f"{label} [{answer.request_id}]"
    is_answered = report.check(
        answer.status == 200 and answer.error is None and bool(answer.text),
        f"{who}: HTTP {answer.status}, {len(answer.text)} chars"
        + (f", error {answer.error}" if answer.error else ""),
    )
    if not is_answered:
        return
    if moved is not None:
        # The instance that finished it served prompt + tokens whole: its usage speaks of that.
        report.check(
            False, f"{who}: its stream moved to another instance mid-way ({moved}): nothing proves it"
        )
        return
    ok, said = answer.evidence.transfer()
    report.check(ok, f"{who}: {said}" + (f" (hand-over: {handover})" if handover else ""))
    oracle_id = f"{answer.request_id}-oracle"
    report.request_ids.append(oracle_id)
    headers = {**(reference.headers or {}), "X-Request-Id": oracle_id}
    agreement = kvproof.teacher_forced(reference.base, model, answer.evidence, headers=headers, post=post)
    num_tokens = len(answer.evidence.token_ids)
    report.check(
        agreement.within(tolerance) and num_tokens >= kvproof.MIN_ANSWER_TOKENS,
        f"{who}: its logprobs agree with {reference.name} scoring the same tokens, no PD "
        f"({agreement.says()}; tolerance {tolerance.describe()}"
        + ("" if num_tokens >= kvproof.MIN_ANSWER_TOKENS else f"; needs {kvproof.MIN_ANSWER_TOKENS} tokens")
        + ")",
    )
    if tolerance.exact_text and alone is not None:
        report.check(
            alone.status == 200 and alone.text == answer.text,
            f"{who}: same greedy text as {reference.name} alone"
            + ("" if alone.text == answer.text else f" (PD {answer.text!r} vs alone {alone.text!r})"),
        )


def _listing(report: Report, instances: list[dict[str, Any]]) -> tuple[int, int, bool]:
    """Checks of what the proxy lists; (number that prefill, number that decode, elastic?)."""
    elastic = [i for i in instances if i["role"] == "elastic"]
    if elastic:  # one pool, each instance either role per request: it splits only with two or more
        report.check(len(elastic) >= 2, f"the proxy lists {len(elastic)} elastic instance(s) (splits need 2)")
        num_prefill = num_decode = len(elastic)
    else:
        num_decode = sum(1 for i in instances if i["role"] == "decode")
        num_prefill = len(instances) - num_decode
        # With no instance of a role there is nothing to prove PD with: a failed check, not a pass.
        report.check(num_prefill > 0, f"the proxy lists {num_prefill} prefill instance(s)")
        report.check(num_decode > 0, f"the proxy lists {num_decode} decode instance(s)")
    for inst in instances:
        report.check(inst["healthy"], f"{inst['role']} instance {inst['url']} is healthy")
    return num_prefill, num_decode, bool(elastic)


def verify(
    proxy_url: str,
    say: Callable[[str], None] = print,
    tolerance: Tolerance = kvproof.BF16,
    admin_key: str | None = None,
    waiting: Waiting | None = None,
) -> Report:
    """The checks; Stalled if one of verify's requests got no answer while nothing moved (or past
    ``waiting.limit_s``), VerifyError if the proxy cannot be reached."""
    proxy_url = proxy_url.rstrip("/")
    report = Report()
    post = Patient(proxy_readings(proxy_url, admin_key), waiting, say).post_json
    status, instances = http_json(f"{proxy_url}/instances", timeout=10)
    if status != 200 or not isinstance(instances, list):
        raise VerifyError(f"{proxy_url}/instances answered {status}: is this a pdserve proxy?")
    num_prefill, num_decode, is_elastic = _listing(report, instances)
    if not report.ok:
        return report
    status, models = http_json(f"{proxy_url}/v1/models", timeout=10)
    if not report.check(status == 200, f"/v1/models answered {status}"):
        return report
    model = models["data"][0]["id"]
    max_model_len = models["data"][0].get("max_model_len")
    pool = f"an elastic pool of {num_decode}" if is_elastic else f"{num_prefill} prefill, {num_decode} decode"
    say(f"model {model}; {pool} instance(s)")
    reference = find_reference(proxy_url, instances, admin_key, say)
    min_tokens = kvproof.min_prompt_tokens(reference.block_size)
    say(f"answer oracle: teacher-forced logprobs on {reference.name}, tolerance {tolerance.describe()}")
    say(
        f"prompts: fresh, at least {min_tokens} tokens ({kvproof.MIN_PROMPT_BLOCKS} KV blocks of {reference.block_size or f'{kvproof.DEFAULT_BLOCK_SIZE} (assumed)'})"
    )

    nonce = uuid.uuid4().hex[:8]
    num_words = int(min_tokens * 1.2)
    if isinstance(max_model_len, int):  # the longest tokenization must still fit with the answer
        num_words = min(num_words, (max_model_len - kvproof.MIN_ANSWER_TOKENS - 64) // _MAX_TOKENS_PER_WORD)
    never_split: list[str] = []
    unread: list[str] = []
    say(f"its requests: X-Request-Id verify-{nonce}-* (the proxy's /requests?id=…, `pdserve trace`)")
    for i, (label, path, body) in enumerate(cases(model, num_words)):
        endpoint = "chat" if "chat" in path else "completions"
        request_id = f"verify-{nonce}-{i}"
        say(f"{label}: sending {request_id}")
        report.request_ids.append(request_id)
        answer = ask(proxy_url, path, kvproof.with_evidence(body, endpoint), request_id=request_id, post=post)
        split = split_of(proxy_url, request_id, admin_key)
        if split.kept_whole is not None and answer.status == 200:
            # Served whole (a short prompt for an elastic pool or --skip-prefill-below): once more, longer.
            longer = _fit(body, answer.evidence.prompt_tokens, max_model_len)
            if longer is not None:
                body, request_id = longer, f"{request_id}-longer"
                say(f"{label}: served whole, sending {request_id}, longer")
                report.request_ids.append(request_id)
                answer = ask(
                    proxy_url, path, kvproof.with_evidence(body, endpoint), request_id=request_id, post=post
                )
                split = split_of(proxy_url, request_id, admin_key)
        report.answers.append((label, answer))
        unread += [split.unknown] if split.unknown else []
        who = f"{label} [{answer.request_id}]"
        if split.kept_whole is not None and answer.status == 200:
            report.check(
                False, f"{who}: the proxy served it whole ({split.kept_whole}): no transfer to prove"
            )
            never_split.append(split.kept_whole)
            continue
        prompt_tokens = answer.evidence.prompt_tokens or 0
        if answer.status == 200:
            report.check(
                prompt_tokens >= min_tokens,
                f"{who}: its prompt is {prompt_tokens} tokens (at least {min_tokens}: "
                f"{kvproof.MIN_PROMPT_BLOCKS} KV blocks)",
            )
        alone = None
        if tolerance.exact_text and not body.get("stream"):
            salted = {**body, "cache_salt": kvproof.fresh_salt("alone")}
            report.request_ids.append(f"{request_id}-alone")
            alone = ask(
                reference.base,
                path,
                salted,
                request_id=f"{request_id}-alone",
                headers=reference.headers,
                post=post,
            )
        check_answer(
            report, label, answer, reference, model, tolerance, alone, split.moved, post, split.handover
        )
    if len(never_split) == len(report.answers):
        report.check(False, f"cannot prove: this pool never splits ({never_split[0]})")
    if unread:
        say(f"could not read the proxy's /requests ({unread[0]}): each request's own evidence speaks")
    say("requests sent: " + ", ".join(report.request_ids))
    return report


def _fit(body: dict[str, Any], prompt_tokens: int | None, max_model_len: int | None) -> dict[str, Any] | None:
    """``body`` with a prompt as long as the model allows (up to 4×), or None if it cannot be longer."""
    room = (max_model_len or 4 * (prompt_tokens or 1)) - kvproof.MIN_ANSWER_TOKENS - 64
    factor = min(4, room // max(prompt_tokens or 1, 1))
    return _longer(body, factor) if factor >= 2 else None
