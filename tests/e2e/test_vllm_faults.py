"""Key faults on real vLLM: every request ends promptly with an answer or a clear error, prefill's KV
comes back, the session Stack's supervisor restarts a killed instance (as `pdserve up` does), and the
system serves again afterwards. Kills instances, so it runs last in the session (modules run in name
order)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from engineprocs import pgid, wait_until
from warmed import wait_warmed_up, warmups

from pdserve import httpclient
from pdserve.commands.verify import wait_for_transfers
from pdserve.config import ProxyConfig, Timeouts
from pdserve.configparts import HealthChecks
from pdserve.engines.placement import InstanceSpec
from pdserve.engines.transfers import transfer_counts
from pdserve.events import InstanceEvent
from pdserve.prometheus import KV_USAGE, scrape
from pdserve.proxy.serving.thread import ProxyThread
from pdserve.stack import Stack, wait_http_ok

pytestmark = pytest.mark.vllm

LEASE_S = 30.0  # vLLM's default kv_lease_duration: un-pulled KV is held at most this long
QUICK = Timeouts(connect=2, prefill=10, first_token=10, idle=5, decode=20)
RESTART_S = 300.0  # vLLM takes ~45 s to start here; far more on a loaded machine


def _prompt(tag: str, words: int = 60) -> str:
    return f"{tag} {uuid.uuid4().hex[:6]}: " + "the harbour lights came on one by one " * (words // 8)


def _spec(stack: Stack, role: str) -> InstanceSpec:
    return next(s for s in stack.specs if s.role == role)


def _kv_usage(url: str) -> float:
    return scrape(url).get(KV_USAGE, 0.0)


@pytest.fixture
def quick(stack: Stack) -> Iterator[tuple[ProxyThread, openai.OpenAI]]:
    """A proxy with short timeouts in front of the session's instances. It leaves the warm-up of a
    returning instance to the session's proxy: a second canary, sent whenever this proxy's own checks
    see the instance back, would land among the transfers a test counts."""
    proxy = ProxyThread(
        ProxyConfig.pd(
            tuple(stack.urls("prefill")),
            tuple(stack.urls("decode")),
            port=18020,
            timeouts=QUICK,
            health=HealthChecks(warmup_timeout_s=0),
        )
    )
    proxy.start()
    try:
        yield proxy, openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        proxy.stop()


def _serves_again(
    stack: Stack, client: openai.OpenAI, model: str, decode_alone: openai.OpenAI | None = None, num: int = 1
) -> None:
    """After a fault: the instances are healthy and each request moves its KV over NIXL once, with the
    greedy answer decode alone gives (asked second: first, it would cache the prompt and pull nothing)."""
    assert wait_http_ok(f"{stack.proxy_url}/health", timeout=60), (
        "the proxy never saw both roles healthy again"
    )
    if decode_alone is not None:
        # The proxy's warm-up canary pulled once; vLLM may publish that count only with a later engine
        # step, so decode steps once (a whole request, no pull) before the counting starts.
        decode_alone.completions.create(model=model, prompt="flush", max_tokens=1)
        time.sleep(1.0)
    for _ in range(num):
        prompt = _prompt("again")
        before = transfer_counts(stack.urls("decode"))
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert answer.choices[0].text
        delta = wait_for_transfers(stack.urls("decode"), before, expected=1)
        assert (delta.successful, delta.failed) == (1, 0)
        if decode_alone is not None:
            alone = decode_alone.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            assert answer.choices[0].text == alone.choices[0].text


def _supervisor_event(
    stack: Stack, url: str, kind: str, since: float, timeout: float
) -> tuple[float, InstanceEvent]:
    """The first event of ``kind`` for ``url`` the session's supervisor reported after ``since``."""
    deadline = time.monotonic() + timeout
    while True:
        for at, event in list(stack.instance_events):
            if at >= since and event.url == url and event.kind == kind:
                return at, event
        seen = [(e.kind, e.detail) for at, e in stack.instance_events if at >= since]
        assert time.monotonic() < deadline, f"no {kind!r} for {url} within {timeout:.0f} s; saw {seen}"
        time.sleep(0.2)


def _restarted_by_the_supervisor(stack: Stack, spec: InstanceSpec, killed_at: float) -> float:
    """Seconds from the kill until the supervisor had the instance back; asserts what it reported."""
    _, exited = _supervisor_event(stack, spec.url, "exited", killed_at, timeout=10)
    assert exited.detail == "was killed by SIGKILL"
    _supervisor_event(stack, spec.url, "restarting", killed_at, timeout=60)
    ready_at, _ = _supervisor_event(stack, spec.url, "ready", killed_at, timeout=RESTART_S)
    took = ready_at - killed_at
    print(f"[e2e] {spec.name} back {took:.1f} s after SIGKILL", flush=True)
    return took


class _Load:
    """A few clients sending one request after another through the session proxy while a fault runs.

    Every request must end: with decode alone's greedy answer, or with a clear 5xx error. One prompt
    for all, so one expected answer (decode's prefix cache makes most of them pull nothing: that is fine,
    transfers are checked afterwards)."""

    def __init__(self, client: openai.OpenAI, decode_alone: openai.OpenAI, model: str, num: int = 2) -> None:
        self._client, self._model = client, model
        self.prompt = _prompt("load")
        self.expected = self._ask(decode_alone)
        self.outcomes: list[str | openai.APIError] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num)]

    def _ask(self, client: openai.OpenAI) -> str:
        answer = client.completions.create(model=self._model, prompt=self.prompt, max_tokens=8, temperature=0)
        return answer.choices[0].text

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.outcomes.append(self._ask(self._client))
            except openai.APIError as exc:
                self.outcomes.append(exc)
            # Two cores: the instance restarting needs them, and the survivor now answers every request
            # (it computes the prompts itself) rather than refusing it at once.
            self._stop.wait(1.0)

    def __enter__(self) -> _Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)
        if exc_type is None:  # else the test already failed: that failure is the one to read
            assert not any(t.is_alive() for t in self._threads), "a request hung"

    def assert_answered_or_clearly_refused(self) -> list[openai.APIStatusError]:
        """Returns the errors; each is an HTTP 5xx with a message, never a hang or a wrong answer."""
        errors = [o for o in self.outcomes if not isinstance(o, str)]
        codes = sorted({e.status_code for e in errors if isinstance(e, openai.APIStatusError)})
        print(
            f"[e2e] load: {len(self.outcomes) - len(errors)} answered, {len(errors)} errors {codes}",
            flush=True,
        )
        unclear = [e for e in errors if not (isinstance(e, openai.APIStatusError) and e.status_code >= 500)]
        assert not unclear, f"requests ended without a clear HTTP error: {unclear}"
        wrong = [o for o in self.outcomes if isinstance(o, str) and o != self.expected]
        assert not wrong, f"answers differ from decode alone's {self.expected!r}: {wrong}"
        return [e for e in errors if isinstance(e, openai.APIStatusError)]


def _leave_once_prefill_answered(proxy_url: str, model: str, prompt: str, timeout: float = 60) -> None:
    """A client that sends a request and hangs up as soon as the proxy has prefill's answer (its trace
    shows prefill's status): between the two phases, however slow prefill is on a loaded machine."""
    request_id = f"leaver-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
    host, port = proxy_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

        def prefill_status() -> int | None:
            found = httpclient.get(f"{proxy_url}/requests?id={request_id}", 10).json()["requests"]
            return found[0].get("prefill_status") if found else None

        assert wait_until(lambda: prefill_status() is not None, timeout, interval=0.1), (
            "prefill never answered the leaver"
        )
        assert prefill_status() == 200


def test_client_leaving_between_phases_gets_its_kv_back_on_prefill_within_the_lease(
    stack: Stack, quick: tuple[ProxyThread, openai.OpenAI], client: openai.OpenAI, model_name: str
) -> None:
    quick_proxy, _ = quick
    prefill = stack.urls("prefill")[0]
    idle = _kv_usage(prefill)
    decode_pgid = pgid(stack, "decode")
    os.killpg(decode_pgid, signal.SIGSTOP)  # prefill answers; decode never does
    try:
        _leave_once_prefill_answered(quick_proxy.url, model_name, _prompt("leaver"))
        held = _kv_usage(prefill)
        assert held > idle, "prefill should be holding the prompt's KV for the missing decode"
        # Nobody will pull it: vLLM's lease frees it.
        assert wait_until(lambda: _kv_usage(prefill) <= idle, timeout=LEASE_S + 15), (
            f"prefill still holds KV {LEASE_S + 15:.0f} s after the client left"
        )
    finally:
        os.killpg(decode_pgid, signal.SIGCONT)
    _serves_again(stack, client, model_name)


def _kill_during_a_request(
    quick_client: openai.OpenAI, model_name: str, pgid: int, spec: InstanceSpec, prompt: str, expected: str
) -> float:
    """SIGKILL the (stopped) prefill while a request waits on it: decode computes the prompt itself, and
    the request completes soon after the kill with the single-instance answer. Returns the kill's time."""
    outcome: dict[str, object] = {}

    def request() -> None:
        try:
            answer = quick_client.completions.create(
                model=model_name, prompt=prompt, max_tokens=8, temperature=0
            )
            outcome["text"] = answer.choices[0].text
        except openai.APIError as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    os.killpg(pgid, signal.SIGKILL)
    thread.join(timeout=QUICK.prefill + 30)
    assert not thread.is_alive(), "the request hung after prefill died"
    assert "error" not in outcome, f"prefill {spec.name} died and the client was told: {outcome['error']}"
    assert outcome["text"] == expected  # decode computed the prompt: the same answer
    assert float(outcome["at"]) - killed_at < 15  # type: ignore[arg-type]
    return killed_at


@dataclass(frozen=True)
class _Kill:
    """What a test that kills an instance under load works with: the session's stack and its proxy's
    client, a quick proxy's client (short timeouts) for the request the kill cuts, decode alone's client
    (the expected answers) and the model's name."""

    stack: Stack
    client: openai.OpenAI
    quick_client: openai.OpenAI
    decode_alone: openai.OpenAI
    model_name: str

    def victim(self, role: str) -> tuple[InstanceSpec, int]:
        """The role's instance and its process group."""
        return _spec(self.stack, role), pgid(self.stack, role)

    def load(self) -> _Load:
        return _Load(self.client, self.decode_alone, self.model_name)


@pytest.fixture
def kill(
    stack: Stack,
    quick: tuple[ProxyThread, openai.OpenAI],
    client: openai.OpenAI,
    decode_alone: openai.OpenAI,
    model_name: str,
) -> _Kill:
    """The session's pair, for a test that kills one of its instances, with a quick proxy in front."""
    _, quick_client = quick
    return _Kill(stack, client, quick_client, decode_alone, model_name)


def test_prefill_killed_mid_request_leaves_every_request_to_decode_until_up_restarts_it(
    kill: _Kill,
) -> None:
    """Survivors take every role: with the only prefill dead, decode computes each prompt itself (the
    request waiting on prefill when it died too), nothing reaches the clients but slower answers, and
    once prefill is back the transfers resume."""
    stack, client, decode_alone, model_name = kill.stack, kill.client, kill.decode_alone, kill.model_name
    spec, pgid = kill.victim("prefill")
    warmups_before = warmups(stack)
    load = kill.load()
    with load:
        time.sleep(2.0)  # the load is under way
        os.killpg(pgid, signal.SIGSTOP)  # the request is certainly inside prefill when the kill comes
        # The load's prompt: its single-instance answer is known to hold while other requests share the
        # batch (a fresh prompt's greedy text may tip on a near-tie of the random tiny model's logits).
        killed_at = _kill_during_a_request(
            kill.quick_client, model_name, pgid, spec, load.prompt, load.expected
        )
        _restarted_by_the_supervisor(stack, spec, killed_at)
        if stack.topology.device == "cuda":
            # Decode kept the dead prefill's KV buffers mapped (cuda_ipc), which held prefill's GPU memory
            # and refused its restart: the supervisor restarted decode too (docs/gpu.md).
            decode = _spec(stack, "decode")
            _, recycled = _supervisor_event(stack, decode.url, "exited", killed_at, timeout=10)
            assert "to free prefill-0's GPU memory" in recycled.detail
            _supervisor_event(stack, decode.url, "ready", killed_at, timeout=RESTART_S)
    # While prefill was down decode answered in its place. A request whose KV decode was pulling at the
    # instant of the kill may end with vLLM's own KV-transfer error (one decode: nowhere to retry); none
    # is refused for want of a prefill.
    errors = load.assert_answered_or_clearly_refused()
    assert not [e for e in errors if "KV transfer" not in str(e)], errors
    assert len(errors) <= 2, errors
    # The new prefill has a new NIXL engine id: decode met it through the proxy's canary before prefill
    # took a request, and pulls from it.
    wait_warmed_up(stack, warmups_before)
    _serves_again(stack, client, model_name, decode_alone, num=3)


MIGRATED_TOKENS = 400


def _stream_killing_decode_at_its_first_token(
    kill: _Kill, prompt: str, request_id: str
) -> tuple[str, str | None, float]:
    """Streams ``prompt`` through the quick proxy and SIGKILLs decode as soon as the client holds a token;
    returns the text the client read, its finish reason and the kill's time."""
    _, pgid = kill.victim("decode")
    stream = kill.quick_client.completions.create(
        model=kill.model_name,
        prompt=prompt,
        max_tokens=MIGRATED_TOKENS,
        temperature=0,
        stream=True,
        logprobs=20,  # slower to write, less of the stream buffered ahead of a CPU-starved client
        extra_headers={"X-Request-Id": request_id},
    )
    received, texts, killed_at, finish = 0, [], 0.0, None
    for chunk in stream:  # an error event would raise here
        for choice in chunk.choices:
            texts.append(choice.text)
            received += bool(choice.text)
            finish = choice.finish_reason or finish
        if received >= 1 and not killed_at:
            killed_at = time.monotonic()
            os.killpg(pgid, signal.SIGKILL)
    assert killed_at, "the stream ended before decode could be killed"
    return "".join(texts), finish, killed_at


def _finished_trace(proxy_url: str, request_id: str) -> dict[str, Any]:
    """The request's walk-through in /requests once the proxy has counted its outcome (the client can
    read a stream's end before the proxy is done with it)."""
    found: list[dict[str, Any]] = []

    def finished() -> bool:
        found[:] = httpclient.get(f"{proxy_url}/requests?id={request_id}", 10).json()["requests"]
        return bool(found) and found[0]["outcome"] is not None

    assert wait_until(finished, timeout=10), found
    return found[0]


def test_decode_killed_mid_stream_the_stream_goes_on_with_one_instances_text_and_up_restarts_it(
    kill: _Kill,
) -> None:
    """The stream whose decode is SIGKILLed after its first token goes on from the prefill instance (the
    only survivor serves the continuation whole: docs/migration.md) and reads, to its last token, as the
    answer one instance gives alone: no error, no repeat, no gap."""
    stack, client, decode_alone, model_name = kill.stack, kill.client, kill.decode_alone, kill.model_name
    spec, _ = kill.victim("decode")
    prefill = stack.urls("prefill")[0]
    prompt = _prompt("midstream", 16)
    alone = decode_alone.completions.create(
        model=model_name, prompt=prompt, max_tokens=MIGRATED_TOKENS, temperature=0
    )
    quick_url = str(kill.quick_client.base_url).removesuffix("/v1/")
    load = kill.load()
    attempts = 3
    with load:
        for attempt in range(1, attempts + 1):
            warmups_before = warmups(stack)
            request_id = f"midstream-{uuid.uuid4().hex[:8]}"
            text, finish, killed_at = _stream_killing_decode_at_its_first_token(kill, prompt, request_id)
            assert finish == alone.choices[0].finish_reason
            assert text == alone.choices[0].text  # the single instance's answer, across the seam
            trace = _finished_trace(quick_url, request_id)
            if trace["migrations"]:
                break
            # Decode had written the whole stream before the kill landed: on two busy cores the client
            # can be kept off the CPU while the stream fills the socket buffers. The case under test did not
            # happen; once decode is back it is tried again.
            print(f"[e2e] attempt {attempt}: decode finished the stream before the kill", flush=True)
            _restarted_by_the_supervisor(stack, spec, killed_at)
            wait_warmed_up(stack, warmups_before)
        else:
            pytest.fail(f"decode finished the stream before it was killed, {attempts} times")
        assert [m["result"] for m in trace["migrations"]] == ["ok"], trace["migrations"]
        migrated = b'pdserve_migrations_total{result="ok"} 1'
        assert wait_until(lambda: migrated in httpclient.get(f"{quick_url}/metrics", 10).body, timeout=10), [
            line
            for line in httpclient.get(f"{quick_url}/metrics", 10).body.splitlines()
            if b"migrations" in line
        ]
        _restarted_by_the_supervisor(stack, spec, killed_at)
    # While decode restarted the prefill served whole requests in its place: the load's errors are the
    # requests decode held when it died (two load threads at each kill), none a refusal for want of a decode.
    errors = load.assert_answered_or_clearly_refused()
    assert len(errors) <= 2 * attempt and not [e for e in errors if e.status_code == 503], errors
    # The stream's KV was pulled before its first token, and the load's handoffs that died with decode
    # are released by their lease: prefill ends up holding nothing.
    assert wait_until(lambda: _kv_usage(prefill) == 0.0, timeout=LEASE_S + 15)
    # The returning decode met prefill through the proxy's canary (its pull is counted) before it served.
    wait_warmed_up(stack, warmups_before)
    _serves_again(stack, client, model_name, decode_alone, num=3)
