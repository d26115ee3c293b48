"""One canary handoff on one prefill→decode pair, straight to the instances (not through the proxy):
the prefill request as the proxy sends it, a TCP connect to the side channel prefill names, the decode
request with prefill's params, and the evidence: the canary's own cached-token count on decode, which
alone decides whether its KV came over (pdserve.kvproof). Its prompt is fresh from first word to last,
at least ``kvproof.MIN_PROMPT_BLOCKS`` blocks, under a fresh ``cache_salt`` on both legs, so decode holds
no prefix of it. Without that count (a decode started without ``--enable-prompt-tokens-details``) the
canary fails: decode's NIXL counters are every client's, so they give the figures (bytes, time) and can
show that nothing moved, but never that the canary's KV did. Then the answer oracle (decode scores the
canary's tokens teacher-forced, no PD; in float32 also the greedy text of decode alone) and a
prefill-only request there (what prefilling costs).

Decode's prefix cache would make the baselines reuse the canary's pulled blocks, so each carries its
own ``cache_salt`` (vLLM hashes it into the first block): they compute the prompt from scratch, and a
transfer that delivered wrong KV cannot make the oracle agree with it.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from pdserve import httpclient, kvproof, protocol
from pdserve.addresses import is_loopback
from pdserve.doctor.advice import Handoff, duration, prompt_budget, repeats_for, size
from pdserve.doctor.facts import InstanceFacts
from pdserve.doctor.report import PairReport
from pdserve.errors import MetricsUnreadable, Stalled, Unreachable
from pdserve.patience import Patient, Waiting, instance_readings
from pdserve.prometheus import (
    BYTES_SUM,
    DESCRIPTORS_SUM,
    KV_EXPIRED,
    NOTIFS_AFTER_EXPIRY,
    XFER_COUNT,
    XFER_FAILED,
    XFER_TIME_SUM,
    scrape,
)

_SENTENCE: Final = " the river carried the small boat past the old mill, and the miller waved"
_COUNTER_WAIT: Final = 10.0  # vLLM publishes connector stats with engine steps, a little after the answer
_LOCAL_SAMPLES: Final = 2  # prefill-only timings on decode; the fastest is what prefilling costs there
_DEFAULT_LEASE_S: Final = 30.0  # vLLM's kv_lease_duration unless the instances set another
_SCRAPE_TIMEOUT: Final = 15.0  # a busy instance answers /metrics late; late is not unreachable


@dataclass(frozen=True)
class Call:
    """One completions request straight to an instance, timed by the client (so it includes HTTP)."""

    status: int  # 0: the instance could not be reached
    seconds: float
    raw: bytes  # the body, or the connection error's text
    text: str | None = None  # the completion's text, when it answered 200
    prompt_tokens: int | None = None  # vLLM's usage.prompt_tokens
    evidence: kvproof.Evidence = field(default_factory=kvproof.Evidence)

    def says(self) -> str:
        if self.status == 0:
            return f"no answer in {duration(self.seconds)}: {self.raw.decode('utf-8', 'replace')[:600]}"
        return f"HTTP {self.status} in {duration(self.seconds)}" + (
            "" if self.status == 200 else f": {self.raw.decode('utf-8', 'replace')[:300]}"
        )


Post = Callable[..., httpclient.Response]


def _call(url: str, body: dict[str, Any], request_id: str, post: Post) -> Call:
    """``post``: as ``httpclient.post_json``; the canary's waits while the pair makes progress."""
    begun = time.monotonic()
    try:
        response = post(f"{url}/v1/completions", body, headers={"X-Request-Id": request_id})
    except (Unreachable, Stalled) as exc:
        return Call(0, time.monotonic() - begun, str(exc).encode())
    seconds = time.monotonic() - begun
    payload = response.json()
    if response.status != 200 or not isinstance(payload, dict) or not payload.get("choices"):
        return Call(response.status, seconds, response.body)
    usage = payload.get("usage") or {}
    text = str(payload["choices"][0].get("text") or "")
    evidence = kvproof.evidence_of([payload])
    return Call(response.status, seconds, response.body, text, usage.get("prompt_tokens"), evidence)


def _count_tokens(url: str, model: str, text: str) -> int | None:
    """vLLM's own /tokenize; None where it is missing (the simulator, older servers)."""
    try:
        response = httpclient.post_json(f"{url}/tokenize", {"model": model, "prompt": text}, 30)
    except Unreachable:
        return None
    data = response.json()
    return data.get("count") if response.status == 200 and isinstance(data, dict) else None


def build_prompt(url: str, model: str, target_tokens: int) -> tuple[str, int | None]:
    """A prompt of about ``target_tokens`` tokens, fresh from its first word to its last, so no cache
    holds any of it."""
    sample = kvproof.fresh_text(100, "pdserve-doctor-canary")
    probe = _count_tokens(url, model, sample)
    per_word = probe / 100 if probe else len(sample) / 4 / 100  # ~4 characters a token without a tokenizer
    text = kvproof.fresh_text(
        repeats_for(target_tokens, per_word, overhead_tokens=24), "pdserve-doctor-canary"
    )
    return text, _count_tokens(url, model, text)


def probe_side_channel(host: str, port: int, timeout: float = 3.0) -> tuple[bool, str]:
    """A TCP connect to prefill's NIXL side channel, from the host doctor runs on."""
    begun = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, f"connected in {duration(time.monotonic() - begun)}"
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _wait_for_counters(url: str, before: dict[str, float]) -> dict[str, float]:
    """Decode's counters once the canary's transfer (or its failure) is counted, or at the deadline.
    A scrape that times out is not the answer: a starved instance answers late (seen on the 2-core
    machine: decode's /metrics took 25 s while prefill held a lease), so the last good reading stands
    and only no reading at all is an error."""
    deadline = time.monotonic() + _COUNTER_WAIT
    after: dict[str, float] | None = None
    error: MetricsUnreadable | None = None

    def read() -> None:
        nonlocal after, error
        try:
            after = scrape(url, _SCRAPE_TIMEOUT)
        except MetricsUnreadable as exc:
            error = exc

    def is_counted() -> bool:
        return after is not None and (
            _delta(after, before, XFER_COUNT) >= 1 or _delta(after, before, XFER_FAILED) >= 1
        )

    read()
    while not is_counted() and time.monotonic() < deadline:
        time.sleep(0.5)
        read()
    time.sleep(0.5)  # one more read, so a second sample in flight is counted too
    read()
    if after is None:
        raise error or MetricsUnreadable(f"cannot read {url}/metrics")
    return after


def is_this_host(host: str) -> bool:
    """Whether ``host`` is an address of the host (network namespace) this process runs in: one it
    can bind. A loopback address is, for whoever reached the instance through it."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def _side_channel(pair: PairReport, params: dict[str, Any], decode_url: str) -> None:
    """Can decode reach the side channel prefill advertised? Only a connect from decode's host says so:
    from elsewhere a refusal may be a route or firewall decode does not have, and a success proves
    nothing for decode. So doctor says where it tested from, and run on decode's host it is the test."""
    host, port = str(params["remote_host"]), int(params["remote_port"])
    decode_host = urlsplit(decode_url).hostname or ""
    if is_loopback(host) and not is_loopback(decode_host):
        pair.check(
            False,
            f"prefill names its side channel {host}:{port}, a loopback address, but decode runs on "
            f"{decode_host}: decode would connect to itself (set VLLM_NIXL_SIDE_CHANNEL_HOST on prefill)",
        )
    ok, how = probe_side_channel(host, port)
    if is_this_host(decode_host):
        pair.check(
            ok,
            f"prefill's NIXL side channel {host}:{port} accepts TCP from decode's host ({how}; doctor "
            f"runs on {decode_host})",
        )
        return
    where = (
        f"from doctor's host, not decode's ({decode_host}): run `pdserve doctor` there to test decode's "
        "own route"
    )
    if ok:
        pair.add("info", f"prefill's NIXL side channel {host}:{port} accepts TCP {where} ({how})")
    else:  # the canary's decode below is what tells whether decode itself gets through
        pair.add("warn", f"prefill's NIXL side channel {host}:{port} refuses TCP {where} ({how})")


def _short(text: str | None, limit: int = 60) -> str:
    text = text or ""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def run(
    pair: PairReport,
    p: InstanceFacts,
    d: InstanceFacts,
    model: str,
    target_tokens: int,
    max_tokens: int = kvproof.MIN_ANSWER_TOKENS,
    waiting: Waiting | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any] | None:
    """The canary; its checks go into ``pair``, its numbers into ``pair.handoff``. Returns prefill's
    params (None if prefill gave none), for the engine-id checks that follow. On a busy pair each of
    its requests waits while either instance makes progress (``waiting``), saying so through ``say``."""
    post = Patient(
        instance_readings({f"prefill {p.url}": p.url, f"decode {d.url}": d.url}), waiting, say
    ).post_json
    min_tokens = kvproof.min_prompt_tokens(d.block_size or p.block_size)
    budget = prompt_budget(max(target_tokens, min_tokens), d.max_model_len or p.max_model_len, max_tokens)
    text, num_tokens = build_prompt(d.url, model, budget)
    # One salt for both legs (their block hashes must agree), fresh: decode holds no prefix of it.
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_salt": kvproof.fresh_salt("doctor")}  # fmt: skip
    request_id = f"doctor-{uuid.uuid4().hex[:12]}"
    try:
        before_d, before_p = scrape(d.url, _SCRAPE_TIMEOUT), scrape(p.url, _SCRAPE_TIMEOUT)
    except MetricsUnreadable as exc:
        pair.check(False, str(exc))
        return None

    prefilled = _call(p.url, protocol.prefill_body(body), request_id, post)
    if not pair.check(prefilled.status == 200, f"canary prefill on {p.url}: {prefilled.says()}"):
        return None
    try:
        params = protocol.kv_params_from_prefill(prefilled.raw)
    except ValueError as exc:
        pair.check(False, f"prefill's answer: {exc}")
        return None
    num_tokens = prefilled.prompt_tokens or num_tokens or 0
    blocks = params["remote_block_ids"]
    num_blocks = len(blocks[0]) if blocks and isinstance(blocks[0], list) else len(blocks)
    pair.add(
        "info",
        f"canary: a {num_tokens:,}-token prompt; prefill holds {num_blocks} KV block(s) for it as engine "
        f"{str(params['remote_engine_id'])[:8]}…, side channel {params['remote_host']}:{params['remote_port']}",
    )
    pair.params = params
    is_push = params.get("transfer_mode") == "push"
    pair.add(
        "info",
        "transfer mode: push (decode registers its blocks with prefill, prefill WRITEs the KV into them; "
        "prefill's vllm:nixl_* counters move)"
        if is_push
        else "transfer mode: pull (decode READs prefill's blocks; decode's vllm:nixl_* counters move)",
    )
    _side_channel(pair, params, d.url)

    decode_body = kvproof.with_evidence(protocol.decode_body(body, params), "completions")
    decoded = _call(d.url, decode_body, request_id, post)
    is_decoded = pair.check(
        decoded.status == 200, f"canary decode on {d.url} with prefill's params: {decoded.says()}"
    )
    if decoded.seconds >= _DEFAULT_LEASE_S:
        pair.add(
            "warn",
            f"decode took {duration(decoded.seconds)}, longer than vLLM's default KV lease ({_DEFAULT_LEASE_S:g} s): "
            "its pull may have read KV prefill had already released (the text check says if it was wrong)",
        )
    try:
        # A decode that failed its pull answers 500 and counts the failure, a little later; one that
        # refused the request (4xx) or was not reached never touched NIXL: nothing to wait for.
        deltas = _counters(pair, d.url, before_d, p.url, before_p, decoded.status, is_push)
    except MetricsUnreadable as exc:  # an instance that stops answering /metrics mid-canary
        pair.check(False, f"reading the transfer counters: {exc}")
        return params
    if not is_decoded:
        return params

    _own_transfer(pair, decoded.evidence)
    tolerance = tolerance_for(p, d)
    agreement = kvproof.teacher_forced(
        d.url, model, decoded.evidence, headers={"X-Request-Id": f"{request_id}-oracle"}, post=post
    )
    pair.check(
        agreement.within(tolerance),
        f"canary's logprobs agree with decode scoring the same tokens alone, no PD ({agreement.says()}; "
        f"tolerance {tolerance.describe()})"
        + (
            ""
            if agreement.within(tolerance)
            else ": wrong KV arrived, or the two instances compute differently"
        ),
    )
    alone = _call(d.url, {**body, "cache_salt": uuid.uuid4().hex}, f"{request_id}-alone", post)
    # Only in float32: in bf16/fp16 near-tied logits tip either way with the batch's shape.
    if tolerance.exact_text and alone.status == 200 and alone.text == decoded.text:
        pair.check(True, f"canary's greedy text equals decode serving it alone: {_short(decoded.text)}")
    elif tolerance.exact_text:
        pair.check(
            False,
            f"canary's greedy text differs from decode serving it alone: PD {_short(decoded.text)}, alone "
            f"{_short(alone.text) if alone.status == 200 else alone.says()} (wrong KV arrived, or the two "
            "instances compute differently)",
        )
    local = [
        _call(d.url, {**body, "max_tokens": 1, "cache_salt": uuid.uuid4().hex}, f"{request_id}-p{i}", post)
        for i in range(_LOCAL_SAMPLES)
    ]
    timings = [c.seconds for c in local if c.status == 200]
    if not timings:
        pair.check(False, f"a prefill-only request of the same prompt on decode: {local[0].says()}")
        return params
    pair.check(
        True,
        f"a prefill-only request of the same prompt on decode (fresh cache) takes {duration(min(timings))} "
        f"(fastest of {len(timings)})",
    )
    if deltas is not None:
        pair.handoff = Handoff(
            prompt_tokens=int(num_tokens),
            num_blocks=num_blocks,
            block_size=d.block_size or p.block_size,
            prefill_s=prefilled.seconds,
            decode_s=decoded.seconds,
            alone_s=alone.seconds,
            local_prefill_s=min(timings),
            **deltas,
        )
    return params


def tolerance_for(p: InstanceFacts, d: InstanceFacts) -> kvproof.Tolerance:
    """Exact in float32, as both logs say the engines compute; bf16's otherwise (or when unknown)."""
    dtypes = {f.log.dtype if f.log else None for f in (p, d)}
    return kvproof.FLOAT32 if dtypes == {"float32"} else kvproof.BF16


def _own_transfer(pair: PairReport, evidence: kvproof.Evidence) -> None:
    """The canary's own proof, whatever else decode serves meanwhile; without it the canary fails, as
    decode's counters move with every client's transfers."""
    ok, said = evidence.transfer()
    if evidence.cached_tokens is None:
        pair.check(False, f"canary: {said}: nothing proves the canary's own KV came over")
        return
    pair.check(ok, f"canary: {said}")


def _counters(
    pair: PairReport,
    d_url: str,
    before_d: dict[str, float],
    p_url: str,
    before_p: dict[str, float],
    decode_status: int,
    is_push: bool = False,
) -> dict[str, Any] | None:
    """The transfer evidence on the instance that moves the KV (decode READs it in pull mode, prefill
    WRITEs it in push mode: that one counts the transfer), and the late-pull signals on prefill, as
    checks; the deltas a Handoff needs when the canary's transfer was counted."""
    is_moving = decode_status in (200, 500)
    mover, verb = ("prefill", "pushed") if is_push else ("decode", "pulled")
    url, before = (p_url, before_p) if is_push else (d_url, before_d)
    after = _wait_for_counters(url, before) if is_moving else scrape(url, _SCRAPE_TIMEOUT)
    after_p = after if is_push else scrape(p_url, _SCRAPE_TIMEOUT)
    if XFER_COUNT not in after:
        pair.check(False, f"{mover} {url} exports no vllm:nixl_* metrics: it runs without a NixlConnector")
        return None
    count, failed = _delta(after, before, XFER_COUNT), _delta(after, before, XFER_FAILED)
    moved, xfer_s = _delta(after, before, BYTES_SUM), _delta(after, before, XFER_TIME_SUM)
    if failed:  # maybe another client's: the canary's own answer (its status, its evidence) decides
        pair.add(
            "warn",
            f"{mover}'s failed-transfer counter (vllm:nixl_num_failed_transfers) rose by {failed:g} while the "
            "canary ran (its own evidence decides; other clients' transfers count here too)",
        )
    if failed or decode_status != 200:
        return None
    descriptors = _delta(after, before, DESCRIPTORS_SUM) if DESCRIPTORS_SUM in after else None
    is_moved = count >= 1 and moved > 0
    counter = f"{mover}'s transfer counter (vllm:nixl_xfer_time_seconds_count) rose by {count:g}"
    if is_moved:  # the figures; other clients' transfers may be among them, so they prove nothing
        pair.add(
            "info",
            f"{counter}: {size(moved)} of KV {verb} over NIXL in {duration(xfer_s)}"
            + (f" ({descriptors:g} descriptors)" if descriptors else ""),
        )
    else:  # nothing moved at all: not the canary's either
        why = (
            "without the KV pushed (did decode register its blocks with this prefill? both must run "
            "NixlPushConnector)"
            if is_push
            else "without pulling the KV (is it a kv_consumer NixlConnector? did the params reach it?)"
        )
        pair.check(False, f"{counter}: decode answered {why}")
        pair.add(
            "info",
            f"prefill keeps the canary's KV until its lease runs out (kv_lease_duration, {_DEFAULT_LEASE_S:g} s "
            "by default)",
        )
        return None
    if count > 1:
        pair.add(
            "warn",
            f"{mover} counted {count:g} transfers meanwhile (other traffic): the figures are their sum",
        )
    expired, late = _delta(after_p, before_p, KV_EXPIRED), _delta(after_p, before_p, NOTIFS_AFTER_EXPIRY)
    if late:
        # Prefill counts a late pull at its next step, so this may be an earlier request's: the log's
        # request id says whether it was the canary's (run.py).
        pair.add(
            "warn", f"prefill counted {late:g} pull(s) of KV it had already released while the canary ran"
        )
    if expired:
        pair.add("warn", f"prefill let {expired:g} lease(s) expire during the canary")
    return {
        "num_transfers": count,
        "num_failed": failed,
        "bytes": moved,
        "xfer_s": xfer_s,
        "num_descriptors": descriptors,
    }
