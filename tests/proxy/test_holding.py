"""The elastic pool's hold (proxy/pool/holding.py): with a TPOT objective, requests wait at the proxy while
every decode-side instance runs the most the objective allows; room goes first to requests that can
still meet their TTFT, and a late one leaves the room the next arrivals need; nothing waits past the
hold's limit, and a client that leaves gives its turn on.
Driven with the router on a hand-moved clock (tests/proxy/test_elastic.py's), as the flow drives it."""

from __future__ import annotations

import asyncio

import pytest
from test_elastic import H200, SLO, Clock, Member, drive, pool

from pdserve.configparts import ElasticPool
from pdserve.errors import ConfigError
from pdserve.proxy.pool.elastic import ElasticRouter, Placement
from pdserve.proxy.pool.holding import _FRESH_RESERVE, Hold


def full_pool(
    hold_max_s: float = 30.0,
) -> tuple[Hold, ElasticRouter, Clock, list[Member], list[Placement[Member]]]:
    """Eight colocated instances of the H200 profile (1,000-token answers: decode-heavy), each running
    the most its 10 ms TPOT allows: the placements still in flight are returned."""
    clock = Clock()
    router = ElasticRouter(ElasticPool(costs=H200, slo=SLO, hold_max_s=hold_max_s), clock)
    members = pool(8)
    running = drive(router, clock, members, 40, 5, 300, 1000, finish=False)
    assert router.layout == "8 colocated"
    while router.room() >= 1:
        running.append(router.place(members, 300, 1000))
    return Hold(router, hold_max_s, SLO.ttft_ms, clock, asyncio.sleep), router, clock, members, running


async def settle() -> None:
    """Let woken waiters run to their return."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_decode_heavy_pool_runs_each_instance_up_to_what_its_tpot_objective_allows() -> None:
    _, router, _, members, running = full_pool()
    max_batch = router.describe()["max_requests_per_decode"]
    assert isinstance(max_batch, int) and 80 < max_batch < 140  # ~100 at the step's quantile within 10 ms
    counts = {m.url: sum(1 for p in running if p.decode is m) for m in members}
    assert all(abs(n - max_batch) <= 1 for n in counts.values()), counts


def test_no_tpot_objective_no_hold() -> None:
    router = ElasticRouter(ElasticPool(costs=H200), Clock())
    members = pool(8)
    for _ in range(2000):
        router.place(members, 300, 1000)
    assert router.room() == float("inf")


async def test_a_request_waits_for_room_and_is_placed_when_a_stream_ends() -> None:
    hold, router, _, members, running = full_pool()
    waiting = asyncio.ensure_future(hold.wait())
    await asyncio.sleep(0.01)
    assert not waiting.done() and hold.num_waiting == 1
    ended = running.pop()
    hold.done(ended)
    await settle()
    assert waiting.done() and hold.num_held == 1
    placed = router.place(members, 300, 1000)
    assert placed.decode is ended.decode  # the room it left


def still_arriving(router: ElasticRouter, clock: Clock, seconds: float, rate: float = 40) -> None:
    """The traffic goes on: requests arrive at ``rate`` for ``seconds`` (their placement is not the point)."""
    for _ in range(round(rate * seconds)):
        clock.t += 1 / rate
        router.arrive(300, 1000)


async def test_room_goes_first_to_a_request_that_can_still_meet_its_ttft() -> None:
    hold, router, clock, _, running = full_pool()
    late = asyncio.ensure_future(hold.wait())
    await asyncio.sleep(0)
    still_arriving(router, clock, 2.0)  # past its TTFT objective of 1 s, the traffic going on
    fresh = asyncio.ensure_future(hold.wait())
    await asyncio.sleep(0)
    hold.done(running.pop())
    await settle()
    assert fresh.done() and not late.done()
    # The late one waits until the room left exceeds its share of what the next 0.8 s's arrivals need.
    reserve = _FRESH_RESERVE * router.expected_arrivals(SLO.ttft_ms / 1000 * 0.8)
    assert reserve >= 10
    ended = 0
    while not late.done():
        hold.done(running.pop())
        ended += 1
        await settle()
    assert reserve <= ended <= reserve + 2


async def test_a_fresh_request_takes_the_room_a_late_one_leaves() -> None:
    hold, router, clock, _, running = full_pool()
    late = asyncio.ensure_future(hold.wait())
    await asyncio.sleep(0)
    still_arriving(router, clock, 2.0)
    for _ in range(3):
        hold.done(running.pop())  # room, but less than the next arrivals need: the late one waits
    await settle()
    assert not late.done() and router.room() >= 1
    assert await asyncio.wait_for(hold.wait(), 1) == 0.0  # a fresh one is let through at once
    assert not late.done()
    late.cancel()


async def test_once_the_traffic_stops_a_late_request_takes_the_room_as_it_opens() -> None:
    hold, router, clock, _, running = full_pool()
    late = asyncio.ensure_future(hold.wait())
    await asyncio.sleep(0)
    clock.t += 2.0  # nothing arrived since: no fresh request to keep room for
    assert router.expected_arrivals(0.8) == 0
    hold.done(running.pop())
    await settle()
    assert late.done()


async def test_a_client_that_leaves_while_waiting_gives_its_turn_to_the_next() -> None:
    hold, _, _, _, running = full_pool()
    first = asyncio.ensure_future(hold.wait())
    second = asyncio.ensure_future(hold.wait())
    await asyncio.sleep(0)
    hold.done(running.pop())  # wakes the first ...
    first.cancel()  # ... whose client is gone before it is placed
    with pytest.raises(asyncio.CancelledError):
        await first
    await settle()
    assert second.done() and hold.num_waiting == 0


async def test_no_request_waits_past_the_holds_limit() -> None:
    hold, _, _, _, _ = full_pool(hold_max_s=0.05)
    waited = await asyncio.wait_for(hold.wait(), 5)
    assert waited >= 0 and hold.num_overdue == 1 and hold.num_waiting == 0


async def test_a_hold_limit_of_zero_never_holds() -> None:
    hold, _, _, _, _ = full_pool(hold_max_s=0)
    assert await hold.wait() == 0.0 and hold.num_held == 0


def test_a_negative_hold_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match="hold_max_s"):
        ElasticPool(hold_max_s=-1)
