"""The elastic pool's router (proxy/pool/elastic.py): per request, whole or split, on the layout the cost model
ranks best for the recent arrivals; sides move with the load, as few as possible, and an instance that
leaves is forgotten. Driven on a hand-moved clock, as the proxy's flow and the simulated cluster drive it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pdserve.configparts import ElasticPool
from pdserve.errors import ConfigError
from pdserve.proxy.pool.elastic import ElasticRouter, Measured, Placement
from pdserve.proxy.pool.routing import Load
from pdserve.sim.profile import load_profile
from pdserve.slo import Slo

H200 = load_profile("llama3-8b-h200").costs()
SLO = Slo(ttft_ms=1000, tpot_ms=10)


@dataclass
class Member:
    url: str
    num_in_flight: int = 0
    load: Load = field(default_factory=Load)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def pool(n: int = 8) -> list[Member]:
    return [Member(f"http://e{i}") for i in range(n)]


def drive(router: ElasticRouter, clock: Clock, members: list[Member], rate: float, seconds: float,
          prompt: int, output: int, finish: bool = True,
          measure: Callable[[Placement[Member]], Measured] | None = None,
          waiting: int = 0) -> list[Placement[Member]]:  # fmt: skip
    """``rate`` requests/s for ``seconds``, each ending at once (``finish``) or left in flight; each
    measuring what ``measure`` says, if given; ``waiting`` requests held behind each, as the hold says."""
    placements = []
    for _ in range(round(rate * seconds)):
        clock.t += 1 / rate
        p = router.place(members, prompt, output, waiting=waiting)
        if finish:
            router.prefilled(p, prompt)
            router.done(p, measure(p) if measure is not None else None)
        placements.append(p)
    return placements


def router(costs: object = H200, slo: Slo = SLO) -> tuple[ElasticRouter, Clock]:
    clock = Clock()
    return ElasticRouter(ElasticPool(costs=H200 if costs is H200 else costs, slo=slo), clock), clock  # type: ignore[arg-type]


def test_decode_heavy_traffic_is_served_whole_on_a_colocated_pool() -> None:
    r, clock = router()
    members = pool()
    placed = drive(r, clock, members, 40, 12, 300, 1000)
    assert r.layout == "8 colocated"
    assert all(not p.is_split for p in placed[-100:])
    assert r.decisions["split"] < 5  # at most the first second's, planned on one request


def test_prefill_heavy_traffic_is_split_prefill_side_to_decode_side() -> None:
    r, clock = router()
    members = pool()
    placed = drive(r, clock, members, 90, 12, 2000, 128, finish=False)
    assert r.layout.endswith("D") and r.layout.startswith(("4P", "5P", "6P"))
    last = placed[-100:]
    assert all(p.is_split for p in last)
    for p in last:
        assert (
            p.prefill is not None and r.side(p.prefill.url) == "prefill" and r.side(p.decode.url) == "decode"
        )
    num_prefill = int(r.layout.split("P")[0])
    assert sum(1 for m in members if r.side(m.url) == "prefill") == num_prefill
    # Spread: every prefill-side instance took prefills, every decode-side instance decodes.
    assert {p.prefill.url for p in last if p.prefill} == {
        m.url for m in members if r.side(m.url) == "prefill"
    }
    assert {p.decode.url for p in last} == {m.url for m in members if r.side(m.url) == "decode"}
    described = r.describe()
    assert described["layout"] == r.layout and described["load"] is not None


def test_over_a_link_too_slow_to_split_the_pool_stays_colocated() -> None:
    r, clock = router(H200.with_kv_bandwidth(0.5e9), Slo(ttft_ms=300, tpot_ms=20))
    placed = drive(r, clock, pool(), 30, 12, 2000, 128)
    assert r.layout == "8 colocated" and not any(p.is_split for p in placed[-100:])


def test_a_prompt_cheaper_than_a_decode_step_stays_whole_on_a_split_pool() -> None:
    r, clock = router()
    members = pool()
    drive(r, clock, members, 90, 12, 2000, 128)
    assert r.layout != "8 colocated"
    short = r.place(members, 50, 128)
    assert not short.is_split and r.side(short.decode.url) == "decode"


def test_sides_move_with_the_load_and_no_more_instances_than_the_layouts_differ_by() -> None:
    r, clock = router()
    members = pool()
    drive(r, clock, members, 90, 12, 2000, 128)
    before = {m.url: r.side(m.url) for m in members}
    split_layout = r.layout
    drive(r, clock, members, 40, 15, 300, 1000)
    after = {m.url: r.side(m.url) for m in members}
    assert r.layout == "8 colocated" != split_layout
    moved = [u for u in before if before[u] != after[u]]
    assert sorted(moved) == sorted(u for u in before if before[u] == "prefill")  # only the prefill side


def test_a_pinned_pool_keeps_its_layout_whatever_the_traffic() -> None:
    clock = Clock()
    r = ElasticRouter(ElasticPool(costs=H200, slo=SLO, num_prefill=5), clock)
    members = pool()
    drive(r, clock, members, 40, 12, 300, 1000)  # traffic the plan would serve colocated
    assert r.layout == "5P3D (pinned)"  # in /requests' reasons, /metrics and top
    assert sum(1 for m in members if r.side(m.url) == "prefill") == 5
    assert r.room() < float("inf")  # held as the pool holds: a decode side with a TPOT cap
    colocated = ElasticRouter(ElasticPool(costs=H200, slo=SLO, num_prefill=0), clock)
    drive(colocated, clock, members, 90, 12, 2000, 128)  # traffic the plan would split
    assert colocated.layout == "8 colocated (pinned)"
    with pytest.raises(ConfigError, match="num_prefill must be >= 0"):
        ElasticPool(num_prefill=-1)


def test_a_steady_load_does_not_flap_between_layouts() -> None:
    r, clock = router()
    members = pool()
    drive(r, clock, members, 60, 5, 2000, 128)
    layouts = set()
    for _ in range(20):
        drive(r, clock, members, 60, 1, 2000, 128)
        layouts.add(r.layout)
    assert len(layouts) == 1


def test_a_line_at_the_hold_blocks_a_layout_with_less_decode_room_but_causes_no_change() -> None:
    """Requests waiting for decode room keep the pool off a layout whose decode side runs fewer streams
    (the line would drain slower) while the one it has meets the objectives, and move it nowhere the
    traffic alone would not."""
    free, clock = router()
    drive(free, clock, pool(), 40, 12, 300, 1000)
    drive(free, clock, pool(), 90, 6, 1000, 128)
    assert free.layout == "5P3D"  # nobody waiting: the prefill-heavy traffic splits
    held, clock = router()
    members = pool()
    drive(held, clock, members, 40, 12, 300, 1000)
    drive(held, clock, members, 90, 6, 1000, 128, waiting=5)
    assert held.layout == "8 colocated"  # three decode-side instances hold fewer streams than eight
    drive(held, clock, members, 90, 2, 1000, 128)
    assert held.layout == "5P3D"  # the line gone, the change it blocked comes at the next plan
    # The other way round the colocated layout has more room: the line does not block it.
    drive(held, clock, members, 40, 15, 300, 1000, waiting=5)
    assert held.layout == "8 colocated"
    # Nor does a line move a pool the traffic keeps where it is.
    steady, clock = router()
    drive(steady, clock, pool(), 40, 12, 300, 1000, waiting=50)
    assert steady.layout == "8 colocated"


def test_a_line_at_the_hold_keeps_no_layout_that_misses_the_objectives_where_another_meets_them() -> None:
    """Requests wait for decode room, but the layout with more of it has one prefill-side instance for a
    wave of 2,000-token prompts: it misses the TTFT objective for every request, the line included, and
    the layout that meets both objectives takes over though its decode side runs fewer streams."""
    held, clock = router()
    members = pool(4)
    drive(held, clock, members, 45, 12, 2000, 1000)
    assert held.layout == "1P3D"  # long answers: the decode side's room
    drive(held, clock, members, 30, 6, 2000, 200, waiting=5)
    assert held.layout == "2P2D"
    plan = held.describe()
    assert plan["predicted_ttft_ms"] <= SLO.ttft_ms and plan["predicted_tpot_ms"] <= SLO.tpot_ms, plan


def test_the_decode_side_takes_as_many_streams_as_their_own_lengths_allow_not_the_windows_mean() -> None:
    """Within the TPOT objective a decode-side instance runs far more short chat streams than streams
    holding 5,000-token contexts, whatever the recent traffic's mean length says; and each request goes
    where the most room is left."""
    admitted = {}
    for prompt, output in ((300, 200), (5000, 100)):
        r, clock = router()
        members = pool()
        drive(r, clock, members, 40, 12, 2000, 300)  # the window: a mean the two fills below share
        placed = []
        while r.room() >= 1:
            placed.append(r.place(members, prompt, output))
        admitted[prompt] = len(placed)
        decodes = [m for m in members if r.side(m.url) == "decode"]
        counts = [sum(1 for p in placed if p.decode is m) for m in decodes]
        assert max(counts) - min(counts) <= 1  # the same streams everywhere: the room is even
        shown = {m.url: r.batch(m.url) for m in members}  # what /instances shows of each
        assert all((shown[m.url] is None) == (m not in decodes) for m in members)
        assert all(b["running"] >= b["most"] for b in shown.values() if b is not None), shown
    assert admitted[300] > 2.5 * admitted[5000]  # the same window: ~1.8x by its mean alone


def test_an_instance_that_leaves_is_forgotten_and_never_chosen() -> None:
    r, clock = router()
    members = pool()
    drive(r, clock, members, 90, 12, 2000, 128)
    gone = next(m for m in members if r.side(m.url) == "prefill")
    r.forget(gone.url)
    assert r.side(gone.url) is None and gone.url not in r.describe()["sides"]  # type: ignore[operator]
    rest = [m for m in members if m is not gone]
    placed = drive(r, clock, rest, 90, 3, 2000, 128)
    assert all(gone not in (p.prefill, p.decode) for p in placed)
    assert all(r.side(m.url) is not None for m in rest)
    # One instance left: everything whole there.
    alone = r.place(rest[:1], 2000, 128)
    assert not alone.is_split and alone.decode is rest[0]


def test_a_whole_request_goes_where_its_prompt_is_computed_soonest_not_where_fewest_requests_are() -> None:
    r, clock = router()
    members = pool()
    drive(r, clock, members, 40, 12, 300, 1000)
    assert r.layout == "8 colocated"
    first = r.place(members, 2000, 128)
    r.done(first)  # its instance now has the fewest requests, but is still computing that prompt
    clock.t += 0.001
    second = r.place(members, 2000, 128)
    assert second.decode is not first.decode
    clock.t += 1.0  # both prompts computed long since: the first instance is as good as any again
    assert r.place([second.decode, first.decode], 2000, 128).decode is first.decode


def test_a_proxy_worker_seeing_half_the_traffic_plans_for_all_of_it() -> None:
    whole, clock = router()
    drive(whole, clock, pool(), 90, 12, 2000, 128)
    half_clock = Clock()
    half = ElasticRouter(ElasticPool(costs=H200, slo=SLO, traffic_share=0.5), half_clock)
    drive(half, half_clock, pool(), 45, 12, 2000, 128)
    assert half.layout == whole.layout
    assert half.describe()["load"]["rate"] == pytest.approx(90, rel=0.1)  # type: ignore[index]


def test_measurements_move_the_pool_off_a_layout_the_profile_wrongly_believes_meets_the_slo() -> None:
    """Both instances on one H100 with an H200's profile: colocated measured 530 ms TTFT and 18.3 ms TPOT
    where the model said 62 and 6.7, so it misses TPOT <= 15 ms on every request; 1P1D measured 11.5 ms.
    The pool moves to 1P1D once colocated has shown what it measures, and stays there."""
    r, clock = router(slo=Slo(ttft_ms=1500, tpot_ms=15))
    members = pool(2)
    on_this_gpu = {False: Measured(0.53, 0.0183), True: Measured(0.78, 0.0115)}
    first = drive(r, clock, members, 5.6, 2, 2000, 128, measure=lambda p: on_this_gpu[p.is_split])
    assert not first[0].is_split  # the profile alone says colocated
    later = drive(r, clock, members, 5.6, 120, 2000, 128, measure=lambda p: on_this_gpu[p.is_split])
    assert r.layout == "1P1D"
    assert sum(p.is_split for p in later) >= len(later) - 2  # moved within the first second, never back
    assert "measured x" in later[-1].reason
    calibration = r.describe()["calibration"]
    assert calibration["whole_tpot"] * 6.7 > 15  # type: ignore[index]  # colocated measured to miss
    assert calibration["split_tpot"] == pytest.approx(11.5 / 5.3, rel=0.15)  # type: ignore[index]


def test_measurements_that_match_the_model_change_nothing() -> None:
    r, clock = router()
    members = pool()
    drive(r, clock, members, 90, 12, 2000, 128)
    as_planned = r.layout
    again, clock = router()

    def as_predicted(p: Placement[Member]) -> Measured:
        assert p.predicted is not None
        return Measured(*p.predicted)

    drive(again, clock, members, 90, 12, 2000, 128, measure=as_predicted)
    assert again.layout == as_planned


def drive_mixed(router: ElasticRouter, clock: Clock, members: list[Member], rate: float, seconds: float,
                lengths: list[tuple[int, int]]) -> list[tuple[int, Placement[Member]]]:  # fmt: skip
    """``rate`` requests/s cycling through ``lengths`` (prompt, answer), each ending at once."""
    placed = []
    for i in range(round(rate * seconds)):
        clock.t += 1 / rate
        prompt, output = lengths[i % len(lengths)]
        p = router.place(members, prompt, output)
        router.prefilled(p, prompt)
        router.done(p)
        placed.append((prompt, p))
    return placed


def test_on_a_split_layout_short_prompts_stay_whole_on_a_decode_and_long_ones_split() -> None:
    r, clock = router(slo=Slo(ttft_ms=300, tpot_ms=10))
    members = pool(4)
    mix = [(300, 150), (2500, 150), (250, 200), (5000, 100), (200, 150), (3000, 150)]
    placed = drive_mixed(r, clock, members, 20, 12, mix)
    assert r.layout.endswith("D")  # a split layout for this mix
    last = placed[-120:]
    assert all(p.is_split for n, p in last if n >= 2500)
    short = [p for n, p in last if n <= 300]
    assert short and all(not p.is_split and r.side(p.decode.url) == "decode" for p in short)
    assert "within the decode side's spare time" in short[-1].reason
    assert 300 <= r.describe()["whole_below_tokens"] < 2500  # type: ignore[operator]


def test_each_request_is_predicted_by_its_own_length_and_the_queue_it_joins() -> None:
    r, clock = router(slo=Slo(ttft_ms=300, tpot_ms=10))
    members = pool(4)
    drive_mixed(r, clock, members, 20, 12, [(2500, 150), (3000, 150)])
    assert r.layout.endswith("D")
    long = r.place(members, 5000, 100)
    longer_queue = r.place([long.prefill, long.decode], 5000, 100)  # type: ignore[list-item]
    short = r.place(members, 1200, 100)
    assert long.predicted is not None and longer_queue.predicted is not None and short.predicted is not None
    assert short.predicted[0] < long.predicted[0]  # its own prompt
    assert longer_queue.predicted[0] > long.predicted[0] + 0.1  # behind the first 5,000 tokens: 121 ms


def test_a_wave_of_long_prompts_grows_the_prefill_side_within_seconds() -> None:
    r, clock = router(slo=Slo(ttft_ms=300, tpot_ms=10))
    members = pool(4)
    drive_mixed(r, clock, members, 30, 12, [(300, 500), (200, 800)])
    assert r.layout == "4 colocated"
    began = clock.t
    for _ in range(60 * 6):
        drive_mixed(r, clock, members, 60, 1 / 60, [(4000, 100)])
        if r.layout != "4 colocated":
            break
    assert r.layout.endswith("D") and clock.t - began <= 3.0


def test_the_first_second_of_traffic_is_planned_at_its_own_rate_not_one_request_a_second() -> None:
    r, clock = router(slo=Slo(ttft_ms=300, tpot_ms=25))
    members = pool(4)
    drive(r, clock, members, 50, 0.4, 2000, 200)  # 20 requests in 0.4 s: before the first re-plan
    load = r.describe()["load"]
    assert isinstance(load, dict) and 40 <= load["rate"] <= 60


def test_arrivals_that_outrun_the_plan_re_plan_before_the_interval_is_up() -> None:
    clock = Clock()
    r = ElasticRouter(ElasticPool(costs=H200, slo=SLO, replan_s=60.0), clock)
    members = pool(4)
    drive(r, clock, members, 50, 1 / 50, 2000, 128)
    alone = r.describe()["predicted_ttft_ms"]  # one arrival: planned as next to no traffic
    drive(r, clock, members, 50, 1, 2000, 128)
    planned = r.describe()["predicted_ttft_ms"]
    assert isinstance(alone, float) and isinstance(planned, float)
    assert planned > 1.5 * alone  # the prefill side's queue at 50 req/s, seen within the second


def test_a_wave_of_long_prompts_in_a_whole_streams_lifetime_is_not_read_as_the_step_costs_error() -> None:
    """A chat stream served whole while its instance computes a wave of 2,500-token prompts gets its tokens
    at several times the step it joined, as the step costs say it should: the whole kind's factor stays at
    the model's, where judged against the plan's chat traffic it read "twice the model" and ruled
    colocation out for the chat that came after the wave. A stream that measures twice its step with no
    prompt beside it still says the step costs are off."""
    r, clock = router(slo=Slo(ttft_ms=300, tpot_ms=25))
    members = pool(4)
    drive(r, clock, members, 40, 3, 300, 200)
    assert r.layout == "4 colocated"
    planned_tpot_ms = r.describe()["predicted_tpot_ms"]
    assert isinstance(planned_tpot_ms, float)
    slow = []
    for _ in range(10):
        stream = r.place(members, 300, 200)
        assert not stream.is_split and stream.predicted is not None
        first_token = clock.t + 0.05
        wave = 0
        for _ in range(20):  # 50,000 prompt tokens on its instance, 1.2 s of prefill by the step costs
            clock.t += 0.01
            r.prefilled(r.place([stream.decode], 2500, 100), 2500)
            wave += 2500
        tpot = stream.predicted[1] + H200.prefill_per_token_s * wave / 199
        clock.t = first_token + 199 * tpot
        slow.append(tpot)
        r.done(stream, Measured(0.05, tpot))
    assert min(slow) * 1000 > 1.8 * planned_tpot_ms  # what the plan's traffic predicted
    r.place(members, 300, 200)  # re-plans with the kind's factors
    assert r.calibration.whole_tpot == pytest.approx(1.0, abs=0.05)

    slower_gpu, clock = router(slo=Slo(ttft_ms=300, tpot_ms=25))
    drive(slower_gpu, clock, members, 40, 3, 300, 200)
    for _ in range(10):
        stream = slower_gpu.place(members, 300, 200)
        assert stream.predicted is not None
        clock.t += 0.05 + 199 * 2 * stream.predicted[1]
        slower_gpu.done(stream, Measured(0.05, 2 * stream.predicted[1]))
    slower_gpu.place(members, 300, 200)
    assert slower_gpu.calibration.whole_tpot == pytest.approx(2.0, rel=0.05)
