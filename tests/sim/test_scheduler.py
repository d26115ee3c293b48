"""Continuous batching without time: step plans, chunked prefill, admission, preemption and PD states."""

from __future__ import annotations

import pytest

from pdserve.sim.profile import Profile
from pdserve.sim.scheduler import FIRST_TOKEN_ID, NO_TOKEN, Scheduler, StepPlan, output_token
from pdserve.sim.types import RemoteKV, SimRequest, SimRole, TokenEvent

SMALL = Profile(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)


def req(request_id: str, num_prompt: int, max_tokens: int, first: int = 0, **kw: object) -> SimRequest:
    return SimRequest(request_id, tuple(range(first, first + num_prompt)), max_tokens, **kw)  # type: ignore[arg-type]


def remote_for(num_tokens: int) -> RemoteKV:
    return RemoteKV("prefill-0", "p-1", tuple(range(num_tokens // 4 + 1)), num_tokens, "127.0.0.1", 1)


def run(sched: Scheduler, max_steps: int = 10_000) -> dict[str, list[TokenEvent]]:
    """Step until nothing is left to compute; every request's events."""
    events: dict[str, list[TokenEvent]] = {}
    for step in range(max_steps):
        plan = sched.schedule()
        if not plan.has_compute:
            return events
        for request_id, event in sched.update(plan, now=float(step)):
            events.setdefault(request_id, []).append(event)
    raise AssertionError("did not drain")


def tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events]


def step(sched: Scheduler, now: float = 0.0) -> tuple[StepPlan, list[tuple[str, TokenEvent]]]:
    plan = sched.schedule()
    return plan, sched.update(plan, now)


# --- Batching ----------------------------------------------------------------------------------------


def test_a_request_yields_max_tokens_then_finishes_by_length() -> None:
    sched = Scheduler(SMALL, "both")
    sched.add_request(req("a", 10, 5))
    events = run(sched)["a"]
    assert [e.index for e in events] == [0, 1, 2, 3, 4]
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    assert all(FIRST_TOKEN_ID <= t < FIRST_TOKEN_ID + 1000 for t in tokens(events))
    assert sched.kv.usage == 0.0 and sched.num_running == 0


def test_output_tokens_depend_on_seed_prompt_and_position_only() -> None:
    assert output_token(0, 123, 5, 1000) == output_token(0, 123, 5, 1000)
    assert output_token(1, 123, 5, 1000) != output_token(0, 123, 5, 1000)
    assert len({output_token(0, 123, i, 1000) for i in range(50)}) > 40
    a, b = Scheduler(SMALL, "both"), Scheduler(SMALL, "prefill")
    a.add_request(req("x", 9, 6))
    b.add_request(req("y", 9, 6))
    assert tokens(run(a)["x"]) == tokens(run(b)["y"])
    small_vocab = Scheduler(SMALL, "both", vocab_size=7)
    small_vocab.add_request(req("x", 9, 30))
    assert all(100 <= t < 107 for t in tokens(run(small_vocab)["x"]))


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    sched = Scheduler(SMALL, "both")
    sched.add_request(req("long", 80, 2))
    chunks = []
    for _ in range(3):
        plan, outputs = step(sched)
        chunks.append([n for _, n in plan.prefills])
        assert plan.num_prefill_tokens <= SMALL.max_num_batched_tokens
    assert chunks == [[32], [32], [16]]
    assert [e.index for _, e in outputs] == [0]  # the first token comes with the last chunk


def test_decodes_come_first_and_prefill_gets_the_rest_of_the_budget() -> None:
    sched = Scheduler(SMALL, "both")
    for i in range(3):
        sched.add_request(req(f"d{i}", 4, 50, first=100 * i))
    step(sched)  # all three prefilled in one step (12 tokens)
    sched.add_request(req("long", 100, 2, first=1000))
    plan, _ = step(sched)
    assert len(plan.decodes) == 3
    assert plan.prefills[0][1] == SMALL.max_num_batched_tokens - 3
    assert plan.num_decode_ctx_tokens == 3 * 5


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = Scheduler(SMALL, "both")
    for i in range(10):
        sched.add_request(req(f"r{i}", 2, 3, first=10 * i))
    step(sched)
    assert (sched.num_running, sched.num_waiting) == (8, 2)
    assert len(run(sched)) == 10


# --- Capacity ----------------------------------------------------------------------------------------


def test_requests_wait_for_blocks_and_run_when_they_free() -> None:
    profile = Profile(block_size=4, num_blocks=6, max_num_batched_tokens=64, max_model_len=24)
    sched = Scheduler(profile, "both")
    sched.add_request(req("a", 16, 2))  # 4 blocks of 6
    sched.add_request(req("b", 12, 2, first=500))  # 3 more: must wait
    step(sched)
    assert (sched.num_running, sched.num_waiting) == (1, 1)
    events = run(sched)
    assert events["b"][-1].finish_reason == "length"


def test_preempted_request_is_recomputed_and_yields_the_same_tokens() -> None:
    roomy = Scheduler(SMALL, "both")
    tight = Scheduler(
        Profile(block_size=4, num_blocks=7, max_num_batched_tokens=64, max_model_len=24), "both"
    )
    for sched in (roomy, tight):
        sched.add_request(req("first", 6, 10))
        sched.add_request(req("second", 6, 10, first=50))
    expected, got = run(roomy), run(tight)
    assert tight.num_preemptions >= 1 and roomy.num_preemptions == 0
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in expected.items()}
    assert [e.index for e in got["second"]] == list(range(10))
    assert tight.prompt_tokens_computed > roomy.prompt_tokens_computed  # the recomputation
    assert tight.kv.usage == 0.0


def test_the_most_recently_admitted_request_is_the_one_preempted() -> None:
    sched = Scheduler(
        Profile(block_size=4, num_blocks=4, max_num_batched_tokens=64, max_model_len=16), "both"
    )
    sched.add_request(req("old", 4, 8))
    sched.add_request(req("young", 4, 8, first=50))
    step(sched)  # both prefilled, one block each, first tokens out
    for _ in range(4):  # each grows into a second block and fills it
        step(sched)
    assert sched.num_preemptions == 0
    step(sched)  # "old" needs a third block first
    assert sched.num_preemptions == 1
    assert [s.request_id for s in sched.running] == ["old"]
    assert sched.num_waiting == 1


def test_abort_frees_blocks_whatever_the_state() -> None:
    sched = Scheduler(Profile(block_size=4, num_blocks=8, max_num_seqs=1, max_model_len=32), "both")
    sched.add_request(req("running", 8, 20))
    sched.add_request(req("waiting", 8, 20, first=50))
    plan = sched.schedule()
    assert sched.abort("running") and sched.abort("waiting")
    assert sched.update(plan, 0.0) == []  # a step in flight when the abort came yields nothing
    assert sched.kv.usage == 0.0 and not sched.schedule().has_compute
    assert not sched.abort("running")


def test_requests_that_can_never_run_are_refused() -> None:
    sched = Scheduler(SMALL, "prefill")
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        sched.add_request(req("a", 250, 10))
    with pytest.raises(ValueError, match="KV blocks"):
        Scheduler(Profile(block_size=4, num_blocks=2), "both").add_request(req("a", 8, 1))
    with pytest.raises(ValueError, match="prefill engine does not pull"):
        sched.add_request(req("a", 8, 1, remote=remote_for(8)))
    with pytest.raises(ValueError, match="decode engine does not hold"):
        Scheduler(SMALL, "decode").add_request(req("a", 8, 1, hold_for_remote=True))


# --- PD ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "both"])
def test_held_request_finishes_after_its_first_token_and_keeps_its_blocks(role: SimRole) -> None:
    sched = Scheduler(SMALL, role)
    sched.add_request(req("p", 10, 50, hold_for_remote=True))
    _, outputs = step(sched, now=2.0)
    [(request_id, event)] = outputs
    assert request_id == "p"
    assert event.finish_reason == "length" and event.held is not None
    assert event.held.num_tokens == 10 and len(event.held.block_ids) == 3
    assert event.held.expires_at == 2.0 + SMALL.kv_lease_s
    assert sched.kv.usage == 3 / 64 and sched.num_running == 0
    assert sched.release_held("p") == event.held
    assert sched.kv.usage == 0.0


def test_leases_expire_in_order_and_are_counted() -> None:
    sched = Scheduler(SMALL, "prefill")
    for i, now in enumerate((0.0, 1.0)):
        sched.add_request(req(f"p{i}", 5, 1, first=10 * i, hold_for_remote=True))
        step(sched, now)
    lease = SMALL.kv_lease_s
    assert sched.expire_held(lease - 0.5) == []
    assert sched.expire_held(lease + 0.5) == ["p0"]
    assert sched.next_expiry() == 1.0 + lease
    assert sched.expire_held(lease + 5) == ["p1"]
    assert sched.num_kv_expired == 2 and sched.kv.usage == 0.0


def test_remote_request_waits_for_its_pull_then_computes_only_the_last_token() -> None:
    sched = Scheduler(SMALL, "decode")
    sched.add_request(req("d", 10, 3, remote=remote_for(10)))
    plan, outputs = step(sched)
    assert not plan.has_compute and outputs == []
    [job] = plan.pulls
    assert (job.request_id, job.num_blocks) == ("d", 3)
    assert sched.num_waiting == 1 and sched.kv.usage == 3 / 64
    assert not sched.schedule().has_compute  # still pulling
    assert sched.mark_pulled("d")
    plan, outputs = step(sched)
    assert [n for _, n in plan.prefills] == [1]
    assert outputs[0][1].num_cached_tokens == 10  # vLLM counts the whole prompt as loaded
    assert len(run(sched)["d"]) == 2
    assert (sched.prompt_tokens_remote, sched.prompt_tokens_computed) == (9, 1)


def test_failed_pull_ends_the_request_with_an_error_and_frees_its_blocks() -> None:
    sched = Scheduler(SMALL, "decode")
    sched.add_request(req("d", 10, 3, remote=remote_for(10)))
    step(sched)
    request_id, event = sched.mark_pull_failed("d")  # type: ignore[misc]
    assert (request_id, event.token_id, event.finish_reason) == ("d", NO_TOKEN, "error")
    assert sched.kv.usage == 0.0 and sched.num_waiting == 0
    assert not sched.mark_pulled("d")


def test_local_prefix_hits_shrink_what_a_decode_pulls() -> None:
    sched = Scheduler(SMALL, "decode")
    sched.add_request(req("warm", 12, 1))
    run(sched)
    sched.add_request(req("d", 12, 2, remote=remote_for(12)))
    plan, _ = step(sched)
    assert plan.pulls[0].num_blocks == 1  # 2 of 3 blocks were local hits
    sched.mark_pulled("d")
    run(sched)
    assert sched.prompt_tokens_remote == 12 - 1 - 8


def test_a_request_that_arrived_after_the_admission_cutoff_waits_for_a_later_step() -> None:
    sched = Scheduler(SMALL, "both")
    sched.add_request(req("early", 8, 2), now=1.0)
    sched.add_request(req("late", 8, 2, first=100), now=2.0)
    plan = sched.schedule(admit_until=1.5)
    assert [seq.request_id for seq, _ in plan.prefills] == ["early"]
    sched.update(plan, now=2.5)
    assert [seq.request_id for seq, _ in sched.schedule().prefills] == ["late"]
