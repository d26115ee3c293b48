"""Prefix-aware routing and the skip-prefill decision, with plain objects: no HTTP involved."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.blocks import block_hashes
from pdserve.proxy.pool.policies import POLICIES, PolicyOptions
from pdserve.proxy.pool.prefix import PrefixAware, PrefixIndex, should_skip_prefill
from pdserve.proxy.pool.routing import Pick


@dataclass(frozen=True)
class Load:
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass
class Inst:
    url: str
    num_in_flight: int = 0
    load: Load = field(default_factory=Load)


def _prompt(prefix_id: int, prefix_len: int, suffix_id: int, suffix_len: int = 40) -> list[int]:
    """A shared prefix (system prompt) and a per-request tail, as token ids."""
    return [prefix_id * 1000 + i for i in range(prefix_len)] + [5_000_000 + suffix_id] * suffix_len


def _hashes(prompt: list[int]) -> list[int]:
    return block_hashes(prompt, 16)


def test_same_block_after_different_prefixes_hashes_differently() -> None:
    tail = [7] * 16
    assert block_hashes([1] * 16 + tail, 16)[1] != block_hashes([2] * 16 + tail, 16)[1]


def test_shared_prefix_gives_equal_leading_hashes_and_a_partial_block_none() -> None:
    a, b = block_hashes(list(range(40)), 16), block_hashes([*range(32), 99, 98], 16)
    assert len(a) == len(b) == 2
    assert a == b
    assert block_hashes(list(range(15)), 16) == []


def test_requests_with_different_cache_salts_share_no_blocks() -> None:
    tokens = list(range(64))
    assert block_hashes(tokens, 16, salt="tenant-a") != block_hashes(tokens, 16, salt="tenant-b")
    assert set(block_hashes(tokens, 16, salt="tenant-a")).isdisjoint(block_hashes(tokens, 16))


def test_requests_sharing_a_system_prompt_stick_to_one_instance_while_load_stays_balanced() -> None:
    policy, instances = PrefixAware(), [Inst("p0"), Inst("p1")]
    chosen: dict[int, set[str]] = {0: set(), 1: set()}
    for n in range(20):
        system = n % 2  # two long system prompts, requests alternating between them
        chosen[system].add(policy.pick(instances, _hashes(_prompt(system, 1024, n))).instance.url)
    assert len(chosen[0]) == len(chosen[1]) == 1  # each system prompt always on the same instance
    assert chosen[0] != chosen[1]  # and the two share the work


def test_a_hot_prefix_spills_to_a_second_instance_once_the_first_is_busy() -> None:
    policy, instances = PrefixAware(load_cost_tokens=300), [Inst("p0"), Inst("p1")]
    routed = []
    for n in range(8):  # none finishes: each adds one request ahead on its instance
        inst = policy.pick(instances, _hashes(_prompt(0, 1024, n))).instance
        inst.num_in_flight += 1
        routed.append(inst.url)
    first = routed[0]
    # 1024 cached tokens outweigh 300 tokens per request ahead while at most 3 requests are ahead.
    assert routed[:4] == [first] * 4
    assert routed[4] != first
    assert set(routed) == {"p0", "p1"}
    assert policy.num_cached_tokens("p0", _hashes(_prompt(0, 1024, 99))) == 1024
    assert policy.num_cached_tokens("p1", _hashes(_prompt(0, 1024, 99))) == 1024


def test_a_loaded_instance_loses_to_an_idle_one_when_the_shared_prefix_is_short() -> None:
    policy = PrefixAware()
    busy, idle = Inst("busy"), Inst("idle", load=Load(kv_usage=0.2))
    policy.index.record("busy", _hashes(_prompt(0, 32, 0)))
    busy.num_in_flight = 3
    assert policy.pick([busy, idle], _hashes(_prompt(0, 32, 1))).instance.url == "idle"


def test_engine_reported_queue_counts_as_load_too() -> None:
    policy = PrefixAware()
    policy.index.record("p0", _hashes(_prompt(0, 512, 0)))
    queued = Inst("p0", load=Load(num_running=4, num_waiting=8))
    assert policy.pick([queued, Inst("p1")], _hashes(_prompt(0, 512, 1))).instance.url == "p1"


def test_without_a_prompt_it_is_least_loaded_with_ties_in_turn() -> None:
    policy = PrefixAware()
    instances = [Inst("a"), Inst("b", num_in_flight=2), Inst("c")]
    assert {policy.pick(instances).instance.url for _ in range(4)} == {"a", "c"}
    assert {policy.pick(instances, []).instance.url for _ in range(4)} == {"a", "c"}


def test_no_match_anywhere_spreads_requests_in_turn() -> None:
    policy, instances = PrefixAware(), [Inst("a"), Inst("b"), Inst("c")]
    assert [policy.pick(instances, _hashes(_prompt(n, 64, n))).instance.url for n in range(3)] == [
        "a",
        "b",
        "c",
    ]


def test_reported_hit_is_what_the_instance_held_before_this_request() -> None:
    policy, instances = PrefixAware(), [Inst("d0")]
    first, again = _hashes(_prompt(0, 256, 0)), _hashes(_prompt(0, 256, 1))
    assert policy.pick(instances, first) == Pick(instances[0], 0)
    assert policy.pick(instances, again) == Pick(instances[0], 256)
    assert policy.pick(instances, again) == Pick(instances[0], 256 + 32)  # its own tail too


def test_no_instance_to_choose_from_raises() -> None:
    with pytest.raises(LookupError):
        PrefixAware().pick([], [1, 2])
    with pytest.raises(LookupError):
        PrefixAware().pick([])


def test_index_stays_within_its_bound_and_evicts_old_tails_first() -> None:
    index = PrefixIndex(max_blocks_per_instance=4)
    old, new = [11, 12, 13], [21, 22, 23]
    index.record("p0", old)
    index.record("p0", new)
    assert index.num_blocks("p0") == 4
    assert index.match_blocks("p0", new) == 3
    assert index.match_blocks("p0", old) == 1  # the old prompt's head survives its tail
    index.record("p0", old)  # used again: most recent now
    assert index.match_blocks("p0", old) == 3
    assert index.num_blocks("p0") == 4


def test_a_forgotten_instance_matches_nothing() -> None:
    index = PrefixIndex()
    index.record("p0", [1, 2, 3])
    index.record("p1", [1, 2, 3])
    index.forget("p0")
    assert (index.match_blocks("p0", [1, 2, 3]), index.match_blocks("p1", [1, 2, 3])) == (0, 3)
    assert index.match_blocks("p1", [1, 9, 3]) == 1  # leading blocks only


def test_only_prompt_aware_policies_ask_for_prompt_tokens() -> None:
    assert PrefixAware().wants_prompt
    wanting = {name for name, factory in POLICIES.items() if factory(PolicyOptions()).wants_prompt}
    assert wanting == {"prefix_aware"}


@pytest.mark.parametrize(
    ("num_prompt", "num_cached", "threshold", "skip"),
    [
        (100, 0, 256, True),  # a short prompt: the split costs more than it saves
        (2000, 0, 256, False),  # a long cold prompt: prefill takes it off decode
        (2000, 1920, 256, True),  # a long prompt whose decode instance holds nearly all of it
        (2000, 1744, 256, False),  # exactly the threshold left to compute: split
        (100, 0, 0, False),  # threshold 0: never skip
        (100, -5, 256, True),  # a nonsense estimate counts as nothing cached
    ],
)
def test_skip_prefill_only_when_decode_has_little_left_to_compute(
    num_prompt: int, num_cached: int, threshold: int, skip: bool
) -> None:
    assert should_skip_prefill(num_prompt, num_cached, threshold) is skip
