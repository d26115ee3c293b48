"""Routing policies, with plain objects: no HTTP involved."""

from __future__ import annotations

import pytest

from pdserve.errors import ConfigError
from pdserve.proxy.pool.policies import POLICIES, make_policy
from pdserve.proxy.pool.routing import RoundRobin


def test_round_robin_takes_each_instance_in_turn() -> None:
    policy = RoundRobin()
    assert [policy.pick(["a", "b", "c"]).instance for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_with_one_instance_always_takes_it() -> None:
    policy = RoundRobin()
    assert {policy.pick(["only"]).instance for _ in range(3)} == {"only"}


def test_round_robin_with_no_instance_raises() -> None:
    with pytest.raises(LookupError):
        RoundRobin().pick([])


def test_each_policy_keeps_its_own_turn() -> None:
    prefill, decode = make_policy("round_robin"), make_policy("round_robin")
    assert prefill.pick(["p0", "p1"]).instance == "p0"
    assert decode.pick(["d0", "d1"]).instance == "d0"
    assert prefill.pick(["p0", "p1"]).instance == "p1"


def test_unknown_policy_name_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="'fastest'") as caught:
        make_policy("fastest")
    for name in POLICIES:
        assert name in str(caught.value)
