"""`pdserve up --engine sim` against a decode stalled past the KV lease: the launcher's log watcher reads
the simulator's prefill log as it reads vLLM's, and the proxy's lease guard drops the answer built from
released blocks and prefills again, exactly as it does for vLLM (tests/e2e/test_kv_integrity.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from pdserve import httpclient
from pdserve.config import ProxySettings, Timeouts
from pdserve.prometheus import parse_prometheus
from pdserve.stack import Stack
from pdserve.topology import RoleSpec, Topology

LEASE_S = 3
STALL_S = LEASE_S + 3
# 22000-22499 belong to the simulator's tests; a sim step of 5 ms makes an answer take a while.
LEASE_ARGS = ("--kv-lease-s", str(LEASE_S))
TOPOLOGY = Topology(
    engine="sim", prefill=RoleSpec(count=1, args=LEASE_ARGS), decode=RoleSpec(count=2, args=LEASE_ARGS),
    proxy_port=22400, first_port=22401, first_side_channel_port=22410,
)  # fmt: skip
TIMEOUTS = Timeouts(connect=1, prefill=5, first_token=3 * STALL_S, idle=5, decode=3 * STALL_S, request=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    topology = Topology(**{**TOPOLOGY.__dict__, "run_dir": str(tmp_path_factory.mktemp("sim-guard"))})
    with Stack(topology, say=lambda _: None, proxy=ProxySettings(timeouts=TIMEOUTS, kv_lease_s=LEASE_S)) as s:
        yield s


def _metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpclient.get(f"{url}/metrics", 10).body.decode())


def _complete(url: str, prompt: str) -> str:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 8}
    response = httpclient.post_json(f"{url}/v1/completions", body, timeout=60)
    assert response.status == 200, response.body
    return str(response.json()["choices"][0]["text"])


def test_a_late_pull_on_a_simulated_prefill_is_caught_from_its_log_and_served_right(stack: Stack) -> None:
    [prefill] = stack.urls("prefill")
    decode = stack.urls("decode")[0]  # the proxy's first decode pick
    prompt = "stalled past the lease"  # under one KV block: no stale prefix left behind on decode
    model = _metrics(prefill)
    assert "vllm:nixl_num_notifications_after_expiry_total" in model
    expected = _complete(prefill, prompt)  # one instance alone
    got: dict[str, str] = {}
    httpclient.post_json(f"{decode}/sim/stall", {"seconds": STALL_S}, timeout=5)
    asking = threading.Thread(target=lambda: got.update(text=_complete(stack.proxy_url, prompt)))
    asking.start()
    asking.join(timeout=60)
    assert got.get("text") == expected
    metrics = httpclient.get(f"{stack.proxy_url}/metrics", 10).body.decode()
    caught = [line for line in metrics.splitlines() if line.startswith("pdserve_kv_handoffs_suspect_total{")]
    assert any('reason="log"' in line and float(line.split()[-1]) >= 1 for line in caught), caught
    assert _metrics(decode)["vllm:nixl_xfer_time_seconds_count"] >= 1  # the late pull "succeeded"
