"""The fault matrix: the real proxy in front of two prefill and two decode sim instances, one injected
fault at a time, every request both streamed and whole, to both completions and chat.

What every case asserts, for every request:
- it ends within a bound derived from the proxy's timeouts (``proxy_rig.TIMEOUTS``), never hangs;
- it ends whole (200, [DONE], max_tokens tokens) or with a clear OpenAI-style error (a JSON error with
  status >= 400, or an SSE error event), never as a silently short answer;
- afterwards no prefill instance holds KV and no engine runs a request (abandoned handoffs expire
  within the lease), and the proxy's ledger has no handoff left open.

Faults are set over the sims' HTTP API (``POST /sim/faults``). Each request gets a fresh proxy, so
health checks, round-robin counters and the ledger of one request do not leak into the next, and every
request goes first to instance 0, where the single-instance faults are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson
import pytest
from proxy_rig import NO_BREAKER, STRICT, TIMEOUTS, running_proxy
from sim_matrix import (
    COMBOS,
    LEASE_S,
    PATHS,
    Answer,
    Kind,
    SimPD,
    ask,
    clear_faults,
    proxy_json,
    proxy_ready,
    request_body,
    seen_unhealthy,
    set_faults,
    settled,
    sim_pd,
    total,
    under_faults,
    wait_until,
)

from pdserve.configparts import ApiKeys
from pdserve.protocol import Endpoint

T = TIMEOUTS
SLACK_S = 2.5  # a loaded 2-core machine (other test runs, engines): scheduling, connect, retry backoff
QUICK_S = 0.5  # a fault answered at once (a 500, a closed connection), retries included
MAX_TOKENS = 8
ADMIN_KEY = "matrix-admin"
HEALTH_NOTICE_S = 10.0  # the proxy's health checks (every 2 s, 5 s timeout) find a down instance by then


@dataclass(frozen=True)
class Expect:
    """How every request of one mode (streamed or whole) must end."""

    kind: Kind
    within_s: float  # before slack
    status: int = 200
    names: str | None = None  # an error's message must name the phase that failed


@dataclass(frozen=True)
class Case:
    faults: dict[str, dict[str, Any]]  # "prefill0", "decode1", ... → fault fields for POST /sim/faults
    streamed: Expect
    whole: Expect
    retried: str | None = None  # every request's walk-through must show a retry of this phase
    # Streamed error events must come within this of the event before them (slow tokens).
    max_error_gap_s: float | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the proxies' own settings


OK_QUICK = Expect("ok", QUICK_S)


def _one(role: str, expect: Expect = OK_QUICK, **fault: Any) -> Case:
    """The fault on the role's first instance only: every request is retried on the other, and answered."""
    return Case({f"{role}0": fault}, expect, expect, retried=role)


def _on_both(role: str, **fault: Any) -> dict[str, dict[str, Any]]:
    """The fault on both of the role's instances."""
    return {f"{role}0": fault, f"{role}1": dict(fault)}


def _both_fail(role: str, expect: Expect, **fault: Any) -> Case:
    """The fault on both of the role's instances, streamed and whole requests ending alike."""
    return Case(_on_both(role, **fault), expect, expect)


# A role's errors reach the client only when the other role may not step in (decode computing the
# prompt, a prefill serving the request whole).
NO_FALLBACK = STRICT_CONFIG = {"retries": STRICT}


def _no_prefill_left(expect: Expect, **fault: Any) -> Case:
    """The fault on both prefills: decode computes the prompt itself (the default), so every request
    is answered, after the prefill attempts that failed."""
    return Case(_on_both("prefill", **fault), expect, expect, retried="prefill")


def _both_decodes_fail(status: int, **fault: Any) -> Case:
    """The fault on both decode instances, met at once: a streamed request ends with an SSE error event,
    a whole one with ``status`` naming decode."""
    return Case(
        _on_both("decode", **fault),
        Expect("stream_error", QUICK_S),
        Expect("error", QUICK_S, status, "decode"),
        config=STRICT_CONFIG,
    )


def _decode_computes_it(**fault: Any) -> Case:
    """The fault on both decode instances' pulls, met at once: vLLM's error (a 500, or streamed, an error
    event before any token) never reaches the client; the last decode, alive, computes the prompt itself
    (the default), before any prefill is asked to stand in."""
    return Case(_on_both("decode", **fault), OK_QUICK, OK_QUICK)


CASES = [
    pytest.param(_one("prefill", error_rate=1), id="one-prefill-answers-500-others-answer"),
    pytest.param(
        _no_prefill_left(OK_QUICK, error_rate=1), id="every-prefill-answers-500-decode-computes-the-prompt"
    ),
    pytest.param(
        dataclasses.replace(
            _both_fail("prefill", Expect("error", QUICK_S, 500, "prefill"), error_rate=1), config=NO_FALLBACK
        ),
        id="every-prefill-answers-500-no-fallback-client-gets-500-naming-prefill",
    ),
    pytest.param(
        _one("prefill", Expect("ok", T.prefill), hang_rate=1),
        id="one-prefill-hangs-answered-by-the-other-after-the-prefill-timeout",
    ),
    pytest.param(
        _no_prefill_left(Expect("ok", 2 * T.prefill), hang_rate=1),
        id="every-prefill-hangs-decode-computes-after-the-timeouts",
    ),
    pytest.param(
        dataclasses.replace(
            _both_fail("prefill", Expect("error", 2 * T.prefill, 504, "prefill"), hang_rate=1),
            config=NO_FALLBACK,
        ),
        id="every-prefill-hangs-no-fallback-client-gets-504-naming-prefill",
    ),
    # The answer is cut off after prefill computed the KV: those blocks stay held until the lease ends.
    pytest.param(_one("prefill", drop_rate=1), id="one-prefill-dies-mid-answer-others-answer"),
    pytest.param(
        _one("decode", error_rate=1), id="one-decode-answers-500-others-answer-after-a-fresh-prefill"
    ),
    pytest.param(
        Case(
            {"decode0": {"hang_rate": 1}},
            Expect("ok", T.first_token),
            Expect("ok", T.decode),
            retried="decode",
        ),
        id="one-decode-hangs-answered-by-the-other-after-the-decode-timeout",
    ),
    pytest.param(
        _both_decodes_fail(502, drop_rate=1),
        id="every-decode-dies-mid-answer-strict-streams-end-with-an-error-event",
    ),
    pytest.param(
        # Each decode in turn breaks the stream; the prefill, standing in, serves the continuation whole.
        Case(_on_both("decode", drop_rate=1), OK_QUICK, OK_QUICK),
        id="every-decode-dies-mid-answer-a-prefill-serves-whole-requests-and-continues-streams",
    ),
    pytest.param(_one("decode", pull_fail_rate=1), id="one-decode-cannot-pull-kv-others-answer"),
    pytest.param(
        _both_decodes_fail(500, pull_fail_rate=1), id="no-decode-can-pull-kv-strict-client-gets-vllms-error"
    ),
    pytest.param(
        _decode_computes_it(pull_fail_rate=1), id="no-decode-can-pull-kv-the-last-computes-the-prompt-itself"
    ),
    pytest.param(
        Case(
            _on_both("decode", token_delay_s=T.idle + 0.4),
            Expect("stream_error", T.first_token + T.idle),
            Expect("error", 2 * T.decode, 504, "decode"),
            max_error_gap_s=T.idle,
            config=STRICT_CONFIG,
        ),
        id="tokens-slower-than-the-idle-timeout-strict-end-with-an-error-not-a-stall",
    ),
    pytest.param(
        # A stream stalls past the idle limit on each decode in turn and goes on from the prefill.
        Case(
            _on_both("decode", token_delay_s=T.idle + 0.4),
            Expect("ok", T.first_token + 2 * T.idle),
            Expect("ok", 2 * T.decode),
        ),
        id="tokens-slower-than-the-idle-timeout-streams-go-on-and-whole-ones-come-from-a-prefill",
    ),
    pytest.param(_one("prefill", down=True), id="one-prefill-down-routed-around"),
    pytest.param(_no_prefill_left(OK_QUICK, down=True), id="every-prefill-down-decode-computes-the-prompt"),
    pytest.param(
        dataclasses.replace(
            _both_fail("prefill", Expect("error", QUICK_S, 502, "prefill"), down=True), config=NO_FALLBACK
        ),
        id="every-prefill-down-no-fallback-client-gets-502-naming-prefill",
    ),
    pytest.param(_one("decode", down=True), id="one-decode-down-routed-around"),
    # A decode that dies mid-answer at several points: a stream goes on from the other decode (a
    # migration, docs/migration.md), a whole request is retried there from the start; both end whole.
    *(
        pytest.param(
            _one("decode", drop_rate=1, drop_after_tokens=k),
            id=f"one-decode-dies-after-{k}-tokens-the-answer-goes-on",
        )
        for k in (1, MAX_TOKENS // 2, MAX_TOKENS - 1)
    ),
]

MATRIX: list[str] = []  # one line per request, printed at the end of the module (pytest -s or -rA)


@pytest.fixture(scope="module")
def sims() -> Iterator[SimPD]:
    with sim_pd() as pd:
        yield pd


@pytest.fixture(scope="module", autouse=True)
def _print_matrix() -> Iterator[None]:
    yield
    if MATRIX:
        print("\nfault matrix (case, mode: outcome status seconds detail)\n" + "\n".join(MATRIX))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def _instance(sims: SimPD, name: str) -> str:
    role, index = name[:-1], int(name[-1])
    return (sims.prefill if role == "prefill" else sims.decode)[index]


def _problems(answer: Answer, expect: Expect, max_error_gap_s: float | None) -> list[str]:
    problems = []
    if answer.kind != expect.kind:
        problems.append(f"ended {answer.kind} ({answer.status}: {answer.detail}), expected {expect.kind}")
    elif expect.kind == "error":
        if answer.status != expect.status:
            problems.append(f"status {answer.status}, expected {expect.status} ({answer.detail})")
        if expect.names and expect.names not in answer.detail:
            problems.append(f"error does not name {expect.names}: {answer.detail}")
    if answer.elapsed_s > expect.within_s + SLACK_S:
        problems.append(f"took {answer.elapsed_s:.2f} s, bound {expect.within_s + SLACK_S:g} s")
    if (
        max_error_gap_s is not None
        and answer.kind == "stream_error"
        and answer.error_gap_s > max_error_gap_s + SLACK_S
    ):
        problems.append(
            f"error event {answer.error_gap_s:.2f} s after the last token, bound {max_error_gap_s:g} s + slack"
        )
    return problems


def _record(case_id: str, answer: Answer) -> None:
    detail = answer.detail if len(answer.detail) < 90 else answer.detail[:87] + "..."
    MATRIX.append(
        f"{case_id:<70} {answer.mode:<22} {answer.kind:<12} {answer.status:>3} {answer.elapsed_s:6.2f}s  {detail}"
    )


def _proxy(sims: SimPD, **config: Any) -> AbstractContextManager[str]:
    return running_proxy(
        sims.prefill, sims.decode, kv_lease_s=LEASE_S, api_keys=ApiKeys(admin=ADMIN_KEY), **config
    )


@pytest.mark.parametrize("case", CASES)
async def test_every_request_ends_in_time_whole_or_with_a_clear_error(
    case: Case, sims: SimPD, http: aiohttp.ClientSession, request: pytest.FixtureRequest
) -> None:
    case_id = request.node.callspec.id
    # One fresh proxy per request: round robin then sends each first to instance 0, where the
    # single-instance faults are, so every mode meets the fault (and a retry goes to instance 1).
    with ExitStack() as proxies:
        urls = [proxies.enter_context(_proxy(sims, **case.config)) for _ in COMBOS]
        faults = {_instance(sims, name): fault for name, fault in case.faults.items()}

        async def one(url: str, endpoint: Endpoint, stream: bool) -> tuple[Answer, list[str]]:
            return await _ask_and_check(http, url, case, endpoint, stream)

        answers = await under_faults(http, urls, faults, sims.urls, one)
    ended = time.monotonic()
    problems = []
    for answer, answer_problems in answers:
        _record(case_id, answer)
        problems += [f"{answer.mode}: {p}" for p in answer_problems]
    assert not problems, "\n".join(problems)
    took = await settled(http, sims, LEASE_S + SLACK_S - (time.monotonic() - ended))
    MATRIX.append(f"{case_id:<70} engines idle, prefill KV released {took:.1f} s after the last answer")


async def _ask_and_check(
    http: aiohttp.ClientSession, url: str, case: Case, endpoint: Endpoint, stream: bool
) -> tuple[Answer, list[str]]:
    expect = case.streamed if stream else case.whole
    request_id = f"matrix-{endpoint}-{'streamed' if stream else 'whole'}-{time.monotonic_ns()}"
    limit = expect.within_s + SLACK_S + 5  # beyond the bound: a hang, reported as such
    answer = await ask(http, url, endpoint, stream, request_id, MAX_TOKENS, limit)
    problems = _problems(answer, expect, case.max_error_gap_s)
    [trace] = [
        t
        for t in (await proxy_json(http, url + "/requests", ADMIN_KEY))["requests"]
        if t["request_id"] == request_id
    ]
    # A stream that had tokens goes on from another decode by a migration, not a retry (migrate.py).
    migrated = case.retried == "decode" and any(m["result"] == "ok" for m in trace["migrations"])
    if (
        case.retried is not None
        and not migrated
        and not any(r.startswith(case.retried) for r in trace["retries"])
    ):
        problems.append(f"not retried on another {case.retried} instance (the fault was not met?): {trace}")
    problems += await _open_handoffs_after(http, url)
    return answer, problems


async def _open_handoffs_after(http: aiohttp.ClientSession, url: str) -> list[str]:
    """Complaints about handoffs the proxy's ledger still has open (it may close the last one just
    after the client's answer ends, so this waits a moment)."""

    async def still_open() -> str | None:
        ledger = await proxy_json(http, url + "/admin/ledger", ADMIN_KEY)
        return orjson.dumps(ledger["open"]).decode() if ledger["open"] else None

    try:
        await wait_until(still_open, 1.0)
    except AssertionError as exc:
        return [f"proxy ledger has open handoffs: {exc}"]
    return []


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_down_instance_is_skipped_once_health_checks_notice(
    role: str, sims: SimPD, http: aiohttp.ClientSession
) -> None:
    # One failed check is enough here; by default a once-healthy instance needs three in a row.
    with _proxy(sims, health=dataclasses.replace(NO_BREAKER, unhealthy_after_checks=1)) as url:
        await proxy_ready(http, url)
        await set_faults(http, _instance(sims, f"{role}0"), down=True)
        try:
            down_url = _instance(sims, f"{role}0")
            instances = await seen_unhealthy(http, url, down_url, HEALTH_NOTICE_S)
            answers = [
                await ask(http, url, endpoint, stream, f"skip-{role}-{endpoint}-{stream}", MAX_TOKENS, 5.0)
                for endpoint, stream in COMBOS
            ]
        finally:
            await clear_faults(http, sims.urls)
        traces = (await proxy_json(http, url + "/requests", ADMIN_KEY))["requests"]
    assert [i["healthy"] for i in instances if i["url"] == _instance(sims, f"{role}0")] == [False], instances
    assert [(a.mode, a.kind) for a in answers] == [(a.mode, "ok") for a in answers], answers
    assert [t["retries"] for t in traces] == [[]] * len(COMBOS), "requests went to the down instance"


# --- Clients that hang up ---------------------------------------------------------------------------


HangUpWhen = Literal["prefill holds KV", "decode called", "decode generating"]


@dataclass(frozen=True)
class HangUp:
    faults: dict[str, dict[str, Any]]
    hang_up_when: HangUpWhen  # what the test waits for before the clients hang up (see _not_yet)
    max_tokens: int = MAX_TOKENS
    # KV left held on prefill when the client goes runs out its lease; else the engines free at once.
    idle_within_s: float = LEASE_S


HANG_UPS = [
    pytest.param(
        # Prefill has computed (and holds) the KV, but its answer is slow to reach the proxy.
        HangUp(_on_both("prefill", token_delay_s=1.0), "prefill holds KV"),
        id="while-prefill-answers",
    ),
    pytest.param(
        HangUp(_on_both("decode", hang_rate=1), "decode called"),
        id="between-prefill-and-decode",
    ),
    pytest.param(
        HangUp({}, "decode generating", max_tokens=2000, idle_within_s=0.0),  # 2000 steps: 10 s
        id="mid-answer",
    ),
]


async def _listen_until_cancelled(
    http: aiohttp.ClientSession, url: str, endpoint: Endpoint, stream: bool, request_id: str, max_tokens: int,
    num_events: dict[str, int],
) -> None:  # fmt: skip
    """A client that reads its answer until it is cancelled (cancelling makes aiohttp close the
    connection: the client hangs up); counts the SSE events it got."""
    body = orjson.dumps(request_body(endpoint, stream, max_tokens, request_id))
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    async with http.post(url + PATHS[endpoint], data=body, headers=headers) as resp:
        assert resp.status == 200, await resp.read()
        async for chunk in resp.content.iter_any():
            num_events[request_id] = num_events.get(request_id, 0) + chunk.count(b"\n\n")
    raise AssertionError(f"{request_id}: the answer ended before the client hung up")


@pytest.mark.parametrize("hang_up", HANG_UPS)
async def test_client_hanging_up_frees_the_engines_within_the_lease(
    hang_up: HangUp, sims: SimPD, http: aiohttp.ClientSession, request: pytest.FixtureRequest
) -> None:
    case_id = request.node.callspec.id
    generated_before = await total(http, sims.decode, "generation_tokens")
    expired_before = await total(http, sims.prefill, "num_kv_expired")
    num_events: dict[str, int] = {}
    calls = {f"hangup-{case_id}-{e}-{'streamed' if s else 'whole'}": (e, s) for e, s in COMBOS}
    with _proxy(sims) as url:
        await proxy_ready(http, url)
        for name, fault in hang_up.faults.items():
            await set_faults(http, _instance(sims, name), **fault)
        clients = [
            asyncio.create_task(_listen_until_cancelled(http, url, e, s, rid, hang_up.max_tokens, num_events))
            for rid, (e, s) in calls.items()
        ]
        try:

            async def not_yet() -> str | None:
                if failed := [c for c in clients if c.done()]:
                    failed[0].result()  # the answer ended early, or was not a 200: say how
                return await _not_yet(hang_up.hang_up_when, http, sims, url, calls, num_events)

            await wait_until(not_yet, 3.0)
            held = await total(http, sims.prefill, "num_held")
            running = await total(http, sims.decode, "num_running")
            for client in clients:
                client.cancel()
            hung_up = time.monotonic()
            await asyncio.gather(*clients, return_exceptions=True)
        finally:
            for client in clients:
                client.cancel()
            await clear_faults(http, sims.urls)
        traces = await _traces_when_done(http, url, list(calls))
    not_seen = {t["request_id"]: t["error"] for t in traces if t["error"] != "client disconnected"}
    assert not not_seen, f"the proxy did not see these clients hang up: {not_seen}"
    took = await settled(http, sims, hang_up.idle_within_s + SLACK_S - (time.monotonic() - hung_up))
    generated = await total(http, sims.decode, "generation_tokens") - generated_before
    expired = await total(http, sims.prefill, "num_kv_expired") - expired_before
    MATRIX.append(
        f"client hangs up {case_id:<54} at hang-up: KV held {held:g}, decoding {running:g}; "
        f"engines idle {took:.1f} s later; {generated:g} tokens generated, {expired:g} leases expired"
    )
    assert generated < len(calls) * hang_up.max_tokens / 2, "decode kept generating for a gone client"
    assert expired == (held if hang_up.idle_within_s else 0)


async def _not_yet(
    when: HangUpWhen,
    http: aiohttp.ClientSession,
    sims: SimPD,
    url: str,
    calls: dict[str, tuple[Endpoint, bool]],
    num_events: dict[str, int],
) -> str | None:
    """None once the moment to hang up has come, else what is still awaited."""
    if when == "prefill holds KV":
        held = await total(http, sims.prefill, "num_held")
        return None if held == len(calls) else f"prefill holds KV of {held:g} of {len(calls)} requests"
    if when == "decode called":
        traces = (await proxy_json(http, url + "/requests", ADMIN_KEY))["requests"]
        called = [t for t in traces if t["decode_url"] is not None and t["kv_transfer_params"]]
        held = await total(http, sims.prefill, "num_held")
        if len(called) == len(calls) == held:
            return None
        return f"{len(called)} of {len(calls)} requests at decode, prefill holds KV of {held:g}"
    assert when == "decode generating"
    running = await total(http, sims.decode, "num_running")
    streaming = [rid for rid, (_, stream) in calls.items() if stream and num_events.get(rid, 0) >= 2]
    if running == len(calls) and len(streaming) == sum(s for _, s in calls.values()):
        return None
    return f"decode runs {running:g} of {len(calls)} requests; {len(streaming)} streams have tokens"


async def _traces_when_done(http: aiohttp.ClientSession, url: str, request_ids: list[str]) -> list[Any]:
    """The proxy's walk-through of ``request_ids`` once each has ended (its cleanup runs after the client
    has gone)."""
    found: list[Any] = []

    async def pending() -> str | None:
        nonlocal found
        traces = (await proxy_json(http, url + "/requests", ADMIN_KEY))["requests"]
        found = [t for t in traces if t["request_id"] in request_ids]
        done = [t for t in found if t["total_ms"] is not None]
        return None if len(done) == len(request_ids) else f"{len(done)} of {len(request_ids)} requests ended"

    await wait_until(pending, SLACK_S)
    return found


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_an_answer_cut_short_is_never_taken_for_a_whole_one(
    stream: bool, sims: SimPD, http: aiohttp.ClientSession
) -> None:
    """The judge of the matrix itself: a decode that dies mid-answer, asked directly (no proxy to turn
    the cut into an error), must be called truncated."""
    await set_faults(http, sims.decode[0], drop_rate=1)
    try:
        answer = await ask(http, sims.decode[0], "completions", stream, "judge-check", MAX_TOKENS, 5.0)
    finally:
        await clear_faults(http, sims.urls)
    assert answer.kind == "truncated", answer
