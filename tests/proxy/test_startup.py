"""An elastic pool measures a few lone requests of each kind before its first client's (proxy/pool/startup.py):
the router's first placements already carry factors for these instances, shown until its own requests
count."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from memory_upstream import Answer, MemoryUpstream, Script

from pdserve.configparts import ElasticPool
from pdserve.proxy.pool import startup
from pdserve.proxy.pool.breaker import CircuitBreaker
from pdserve.proxy.pool.calibrator import MIN_SAMPLES
from pdserve.proxy.pool.elastic import ElasticRouter, Measured
from pdserve.proxy.pool.instance import Instance
from pdserve.sim.profile import load_profile
from pdserve.slo import Slo

H200 = load_profile("llama3-8b-h200").costs()
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2, 3],
          "remote_request_id": "cmpl-r", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}  # fmt: skip


def slow_engine(base_s: float, per_token_s: float) -> Script:
    """An engine ten times slower than the H200 profile says: a prompt in ``base_s``, each token after."""

    def answer(body: dict[str, Any]) -> Answer:
        payload: dict[str, Any] = {"choices": [{"text": "x"}]}
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            payload["kv_transfer_params"] = PARAMS
        return Answer(body=orjson.dumps(payload), delay_s=base_s + per_token_s * (body["max_tokens"] - 1))

    return answer


def instances() -> tuple[list[Instance], list[MemoryUpstream]]:
    upstreams = [MemoryUpstream("decode", f"http://e{i}:1", slow_engine(0.15, 0.05)) for i in range(3)]
    return [Instance(u, CircuitBreaker()) for u in upstreams], upstreams  # type: ignore[arg-type]


def test_the_first_placement_is_calibrated_by_what_the_start_up_measured() -> None:
    router = ElasticRouter(ElasticPool(costs=H200, slo=Slo(ttft_ms=1000, tpot_ms=25)))
    members, upstreams = instances()
    assert router.calibration_sources() == {"whole": "model", "split": "model"}
    assert asyncio.run(startup.measure(router, members, {}, 10.0)) is None
    assert router.calibration_sources() == {"whole": "startup", "split": "startup"}
    whole_ttft, whole_tpot = router.calibration.factors(False)
    split_ttft, split_tpot = router.calibration.factors(True)
    # 150 ms for a 256-token prompt where the profile says about 15, 50 ms a token where it says 5.
    assert whole_ttft > 5 and split_ttft > 5 and whole_tpot > 3 and split_tpot > 3
    # Whole on the first instance (three times: the first is not counted), then prefill there and decode
    # on the second (three times each: the pair's first handoff is not counted).
    assert [len(u.calls) for u in upstreams] == [6, 3, 0]
    first = upstreams[0].calls[0].body
    assert first["ignore_eos"] and first["cache_salt"].startswith("startup-") and first["max_tokens"] == 1
    assert upstreams[0].calls[2].body["max_tokens"] == 33
    assert upstreams[1].calls[0].body["kv_transfer_params"]["do_remote_prefill"]
    placement = router.place(members, 2000, 128)
    assert "measured x" in placement.reason or not placement.is_split
    assert router.describe()["calibration"]["sources"] == {"whole": "startup", "split": "startup"}  # type: ignore[index]


def test_the_requests_own_measurements_replace_the_start_up_ones_once_they_count() -> None:
    router = ElasticRouter(ElasticPool(costs=H200, slo=Slo(ttft_ms=1000, tpot_ms=25), num_prefill=0))
    assert router.measured_alone(False, 256, 17, Measured(0.05, 0.012))
    assert router.calibration.factors(False)[0] > 2
    members, _ = instances()
    for _ in range(MIN_SAMPLES):
        p = router.place(members, 300, 100)
        assert p.predicted is not None
        router.done(p, Measured(*p.predicted))  # as the model says
    router.place(members, 300, 100)  # re-plans with the requests' own factors
    assert router.calibration.factors(False) == (1.0, 1.0)
    assert router.calibration_sources()["whole"] == "requests"


def test_a_failed_measurement_leaves_the_model_as_it_is() -> None:
    router = ElasticRouter(ElasticPool(costs=H200, slo=Slo(ttft_ms=1000, tpot_ms=25)))

    def refuse(body: dict[str, Any]) -> Answer:
        return Answer(status=503, body=b'{"error": "loading"}')

    members = [
        Instance(MemoryUpstream("decode", f"http://e{i}:1", refuse), CircuitBreaker()) for i in range(2)
    ]  # type: ignore[arg-type]
    error = asyncio.run(startup.measure(router, members, {}, 10.0))
    assert error is not None and "503" in error
    assert router.calibration_sources() == {"whole": "model", "split": "model"}
    no_costs = ElasticRouter(ElasticPool())
    assert not no_costs.measured_alone(True, 256, 17, Measured(0.5, 0.05))
    # A TPOT lost in the noise keeps the model's word for it, and the TTFT still counts.
    assert router.measured_alone(False, 256, 33, Measured(0.5, 0.0))
    assert router.calibration.factors(False)[1] == 1.0 and router.calibration.factors(False)[0] > 10
