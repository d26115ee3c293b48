"""Which decodes hold blocks registered for a push that never came (engines/stranded.py)."""

from __future__ import annotations

from test_launcher import fake_spec

from pdserve.engines.placement import kv_transfer_config
from pdserve.engines.stranded import StrandedWatch, push_registration_timeout
from pdserve.prometheus import KV_USAGE, NUM_RUNNING, NUM_WAITING

IDLE_HOLDING = {NUM_RUNNING: 0.0, NUM_WAITING: 0.0, KV_USAGE: 0.01}


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
    for broken in ({**IDLE_HOLDING, NUM_RUNNING: 1.0}, {**IDLE_HOLDING, NUM_WAITING: 2.0},
                   {**IDLE_HOLDING, KV_USAGE: 0.0}, None):  # fmt: skip
        watch = StrandedWatch(timeout_s=10)
        watch.sample(IDLE_HOLDING, now=0.0)
        assert not watch.sample(broken, now=5.0)
        assert not watch.sample(IDLE_HOLDING, now=12.0)
        assert watch.sample(IDLE_HOLDING, now=22.5)
