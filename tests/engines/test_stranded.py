"""Which decodes hold blocks registered for a push that never came (engines/stranded.py)."""

from __future__ import annotations

from dataclasses import replace

from test_launcher import fake_spec

from pdserve.engines.placement import kv_transfer_config
from pdserve.engines.stranded import DecodeLoad, StrandedWatch, push_registration_timeout

IDLE_HOLDING = DecodeLoad(running=0, waiting=0, deferred=0, kv_usage=0.01)


def test_only_a_push_decode_has_a_registration_watchdog_and_up_sets_it_to_the_lease() -> None:
    push = kv_transfer_config("decode", "cpu", kv_lease_s=12, transfer="push")
    assert push_registration_timeout(fake_spec("decode", 0, "--kv-transfer-config", push)) == 12.0
    pull = kv_transfer_config("decode", "cpu", kv_lease_s=12, transfer="pull")
    assert push_registration_timeout(fake_spec("decode", 0, "--kv-transfer-config", pull)) is None
    prefill = kv_transfer_config("prefill", "cpu", kv_lease_s=12, transfer="push")
    assert push_registration_timeout(fake_spec("prefill", 0, "--kv-transfer-config", prefill)) is None
    assert push_registration_timeout(fake_spec("decode", 0)) is None


def test_blocks_held_while_idle_are_stranded_only_after_the_watchdog_without_a_break() -> None:
    watch = StrandedWatch(timeout_s=10)
    assert not watch.sample(IDLE_HOLDING, now=0.0)
    assert not watch.sample(IDLE_HOLDING, now=9.0)
    assert watch.sample(IDLE_HOLDING, now=10.5)
    # a request running, nothing held, or no answer: the run starts over
    for broken in (replace(IDLE_HOLDING, running=1), replace(IDLE_HOLDING, waiting=2),
                   replace(IDLE_HOLDING, kv_usage=0.0), None):  # fmt: skip
        watch = StrandedWatch(timeout_s=10)
        watch.sample(IDLE_HOLDING, now=0.0)
        assert not watch.sample(broken, now=5.0)
        assert not watch.sample(IDLE_HOLDING, now=12.0)
        assert watch.sample(IDLE_HOLDING, now=22.5)


def test_a_deferred_request_is_idle_only_when_the_proxy_awaits_nothing_at_that_decode() -> None:
    # vLLM keeps a push whose prefill died waiting (deferred), holding its blocks, for good
    orphan = DecodeLoad(running=0, waiting=1, deferred=1, kv_usage=0.01)
    assert orphan.is_idle_holding(lambda: 0)
    assert not orphan.is_idle_holding(lambda: 1)  # maybe a push still on its way: a restart would fail it
    assert not orphan.is_idle_holding(lambda: None)  # the proxy could not say
    # one waiting for room in the batch is work to do, whatever the proxy says
    assert not DecodeLoad(running=0, waiting=2, deferred=1, kv_usage=0.01).is_idle_holding(lambda: 0)


def test_the_load_is_read_from_vllms_metrics_with_deferred_waiting_by_its_reason_label() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 0\n'
        'vllm:num_requests_waiting{engine="0"} 3\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 2\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 1\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
    )
    assert DecodeLoad.parse(text) == DecodeLoad(running=0, waiting=3, deferred=1, kv_usage=0.25)
    # an engine without the reasons: nothing is taken for deferred
    assert DecodeLoad.parse('vllm:num_requests_waiting{engine="0"} 1\n').deferred == 0
