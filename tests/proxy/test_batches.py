"""The elastic router's decode-side batches (proxy/pool/batches.py): how many requests an instance runs
within the TPOT objective follows what it runs and what arrives, not the window's mean lengths."""

from __future__ import annotations

import math

from pdserve.costmodel import batch_within
from pdserve.proxy.pool.batches import DecodeBatches
from pdserve.sim.profile import load_profile

H200 = load_profile("llama3-8b-h200").costs()
Z = 1.6449
PLANNED = 100.0


def running(batches: DecodeBatches, url: str, n: int, prompt: int, output: int, whole: bool) -> float:
    share = batches.share(prompt, output, whole)
    for _ in range(n):
        batches.begin(url, share)
    return share


def test_short_chat_streams_leave_room_that_long_contexts_do_not() -> None:
    batches = DecodeBatches(H200, tpot_ms=10, memory_s=10)
    running(batches, "chat", 40, 300, 200, whole=False)
    running(batches, "agents", 40, 5000, 100, whole=False)
    chat, agents = (batches.cap(url, True, Z, 1.0, PLANNED) for url in ("chat", "agents"))
    assert chat > 150 > 40 > agents  # within 10 ms: ~200 chat streams, ~25 holding 5,000-token contexts
    # Each stream's context costs in every step: the agents' batch is already past what keeps them within.
    assert agents < batches.count("agents")


def test_a_prompt_computed_where_it_decodes_costs_its_batch_room() -> None:
    batches = DecodeBatches(H200, tpot_ms=10, memory_s=10)
    running(batches, "split", 40, 300, 200, whole=False)
    running(batches, "whole", 40, 300, 200, whole=True)
    assert batches.cap("whole", False, Z, 1.0, PLANNED) < 0.6 * batches.cap("split", True, Z, 1.0, PLANNED)


def test_long_answers_arriving_lower_the_room_a_batch_of_chat_shows() -> None:
    # A batch of chat ends within seconds; long answers admitted on its room stay, and their contexts grow.
    batches = DecodeBatches(H200, tpot_ms=10, memory_s=10)
    running(batches, "e0", 40, 300, 200, whole=False)
    before = batches.cap("e0", True, Z, 1.0, PLANNED)
    for k in range(50):
        batches.arrived(k * 0.02, 3000, 800, whole_below=0)
    after = batches.cap("e0", True, Z, 1.0, PLANNED)
    assert after < 0.5 * before
    assert after == math.floor(batch_within(H200, 0.010, batches.share(3000, 800, False), Z))


def test_a_wave_of_long_answers_is_forgotten_once_it_would_have_ended() -> None:
    batches = DecodeBatches(H200, tpot_ms=10, memory_s=10)
    running(batches, "e0", 40, 300, 200, whole=False)
    quiet = batches.cap("e0", True, Z, 1.0, PLANNED)
    for k in range(50):  # a second of 800-token answers: ~8 s of life each at 10 ms a token
        batches.arrived(k * 0.02, 3000, 800, whole_below=0)
    assert batches.cap("e0", True, Z, 1.0, PLANNED) < 0.5 * quiet
    for k in range(600):  # then a minute of chat like what runs (the wave e-folds every 10 s)
        batches.arrived(1 + k * 0.1, 300, 200, whole_below=0)
    assert batches.cap("e0", True, Z, 1.0, PLANNED) >= 0.95 * quiet


def test_an_idle_instance_no_objective_or_no_step_costs_take_the_plans_cap() -> None:
    assert DecodeBatches(H200, tpot_ms=10, memory_s=10).cap("idle", True, Z, 1.0, PLANNED) == PLANNED
    untimed = DecodeBatches(H200, tpot_ms=None, memory_s=10)
    running(untimed, "e0", 5, 300, 200, whole=False)
    assert untimed.cap("e0", True, Z, 1.0, PLANNED) == PLANNED
    uncosted = DecodeBatches(None, tpot_ms=10, memory_s=10)
    assert uncosted.share(300, 200, whole=True) == 0.0
    running(uncosted, "e0", 5, 300, 200, whole=False)
    assert uncosted.count("e0") == 5 and uncosted.cap("e0", True, Z, 1.0, PLANNED) == PLANNED


def test_a_proxy_worker_takes_its_share_of_the_cap() -> None:
    batches = DecodeBatches(H200, tpot_ms=10, memory_s=10)
    running(batches, "e0", 10, 300, 200, whole=False)
    whole_pool = batches.cap("e0", True, Z, 1.0, PLANNED)
    assert batches.cap("e0", True, Z, 0.5, PLANNED) == math.floor(whole_pool * 0.5)


def test_requests_that_end_give_their_room_back_exactly() -> None:
    batches = DecodeBatches(H200, tpot_ms=10, memory_s=10)
    shares = [batches.share(p, 150, whole=p < 1000) for p in (120, 2500, 5000, 333)]
    empty = batches.cap("e0", True, Z, 1.0, PLANNED)
    for s in shares:
        batches.begin("e0", s)
    for s in shares:
        batches.end("e0", s)
    assert batches.count("e0") == 0 and batches.cap("e0", True, Z, 1.0, PLANNED) == empty
    running(batches, "e0", 3, 300, 200, whole=False)
    batches.forget("e0")
    assert batches.count("e0") == 0
