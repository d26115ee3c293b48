"""Prefill's KV lease as vLLM 0.32's NixlConnector keeps it (docs/vllm-kv-lifecycle.md), in the simulated
engine: decode heartbeats, reaping only while prefill steps, a late pull that "succeeds" with wrong
tokens, and stalled engines (SIGSTOP of an EngineCore).

On a VirtualClock: every duration is exact and costs no wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pdserve.engines.logwatch import parse_line
from pdserve.errors import KVPullError
from pdserve.sim.engine import SimEngine, VirtualClock
from pdserve.sim.leases import HolderLeases, ReaderLeases
from pdserve.sim.profile import Profile
from pdserve.sim.scheduler import Scheduler
from pdserve.sim.types import HeldKV, RemoteKV, SimRequest

LEASE_S = 6.0  # vLLM's arithmetic: a heartbeat every 6 // 6 = 1 s, each extending to 6 * 2 // 3 = 4 s ahead
PROFILE = Profile(
    name="lease", step_base_s=0.01, kv_pull_base_s=0.002, block_size=16, num_blocks=512, max_num_seqs=1,
    max_model_len=2048, kv_lease_s=LEASE_S,
)  # fmt: skip
PROMPT = tuple(range(1000, 1040))  # 40 tokens: two full blocks and a part


class Source:
    """Decode's NIXL, straight to in-process prefill engines; heartbeats can be lost on the way."""

    def __init__(self, *holders: SimEngine, heartbeats: bool = True) -> None:
        self.holders = {e.engine_id: e for e in holders}
        self.heartbeats = heartbeats

    async def pull(self, remote: RemoteKV) -> bool:
        if remote.engine_id not in self.holders:
            raise KVPullError(f"no engine {remote.engine_id}")
        return self.holders[remote.engine_id].serve_pull(remote.request_id).is_intact

    def heartbeat(self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]) -> None:
        if self.heartbeats and engine_id in self.holders:
            self.holders[engine_id].heartbeat(request_ids)


@contextlib.asynccontextmanager
async def pd(heartbeats: bool = True) -> AsyncIterator[tuple[SimEngine, SimEngine, SimEngine]]:
    """(prefill, decode, one instance alone) on one clock, running."""
    clock = VirtualClock()
    prefill = SimEngine(PROFILE, "prefill", "p", clock=clock)
    decode = SimEngine(PROFILE, "decode", "d", kv_source=Source(prefill, heartbeats=heartbeats), clock=clock)
    alone = SimEngine(PROFILE, "both", "alone", clock=clock)
    engines = (prefill, decode, alone)
    for engine in engines:
        await engine.start()
    try:
        yield engines
    finally:
        for engine in engines:
            await engine.stop()


async def tokens(engine: SimEngine, req: SimRequest) -> list[int]:
    return [e.token_id async for e in engine.generate(req)]


async def handoff(prefill: SimEngine, request_id: str, prompt: tuple[int, ...] = PROMPT) -> RemoteKV:
    """Prefill computes ``prompt`` and holds its KV; the params decode gets."""
    [event] = [e async for e in prefill.generate(SimRequest(request_id, prompt, 1, hold_for_remote=True))]
    assert event.held is not None
    return RemoteKV(prefill.engine_id, request_id, event.held.block_ids, event.held.num_tokens, "h", 0)


@contextlib.asynccontextmanager
async def handed_off() -> AsyncIterator[tuple[SimEngine, SimEngine, SimEngine, RemoteKV]]:
    """``pd()`` once prefill has computed request "r"'s prompt and holds its KV: the three engines and
    the params decode gets for "r"."""
    async with pd() as (prefill, decode, alone):
        yield prefill, decode, alone, await handoff(prefill, "r")


def lease_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """Prefill's lease lines as pdserve's log watcher reads them: (kind, remote_request_id)."""
    parsed = (parse_line(r.getMessage()) for r in caplog.records if r.name == "pdserve.sim")
    return [p for p in parsed if p is not None]


@pytest.mark.parametrize("heartbeats", [True, False], ids=["heartbeats", "heartbeats-lost"])
async def test_a_request_queued_at_decode_past_the_lease_keeps_its_kv_while_decode_heartbeats(
    heartbeats: bool,
) -> None:
    async with pd(heartbeats) as (prefill, decode, alone):
        clock = decode.clock
        busy = asyncio.create_task(tokens(decode, SimRequest("busy", tuple(range(8)), 1000)))  # ~10 s
        await clock.sleep(0.1)
        remote = await handoff(prefill, "r")
        # max_num_seqs=1: it waits behind "busy" for ~10 s, far past the 6 s lease.
        got = await tokens(decode, SimRequest("r", PROMPT, 8, remote=remote))
        await busy
        expected = await tokens(alone, SimRequest("x", PROMPT, 8))
    if heartbeats:
        assert got == expected
        assert (prefill.stats.num_kv_expired, decode.stats.num_stale_reads) == (0, 0)
    else:
        assert got != expected  # vLLM without heartbeats: the pull reads released blocks
        assert (prefill.stats.num_kv_expired, decode.stats.num_stale_reads) == (1, 1)


async def test_a_stalled_decode_sends_no_heartbeat_its_late_pull_succeeds_with_wrong_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with handed_off() as (prefill, decode, alone, remote):
        decode.stall(LEASE_S + 2)  # the request reaches decode, whose engine does not step
        got = await tokens(decode, SimRequest("r", PROMPT, 8, remote=remote))
        assert decode.clock.now() >= LEASE_S + 2
        expected = await tokens(alone, SimRequest("x", PROMPT, 8))
        assert got != expected and len(got) == 8  # a whole, normal-looking answer
        assert (decode.stats.num_pulls_ok, decode.stats.num_pulls_failed) == (1, 0)  # counted as a transfer
        assert lease_lines(caplog) == [("expired", "r")]
        # Prefill, holding nothing, reads decode's late notification only when it steps again.
        assert prefill.stats.num_notifications_after_expiry == 0
        await handoff(prefill, "next", tuple(range(5000, 5010)))
        assert prefill.stats.num_notifications_after_expiry == 1
        assert lease_lines(caplog) == [("expired", "r"), ("late_pull", "r")]


async def test_a_stalled_prefill_reaps_nothing_so_a_read_during_the_stall_is_intact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with handed_off() as (prefill, decode, alone, remote):
        clock = decode.clock
        prefill.stall(2 * LEASE_S)
        await clock.sleep(LEASE_S + 1)  # past the lease, but nothing reaps it
        assert prefill.stats.num_held == 1
        got = await tokens(decode, SimRequest("r", PROMPT, 8, remote=remote))
        assert got == await tokens(alone, SimRequest("x", PROMPT, 8))
        await clock.sleep(LEASE_S)  # prefill resumes: the read is handled before the reaping
        stats = prefill.stats
        assert (stats.num_held, stats.kv_usage, stats.num_kv_expired) == (0, 0.0, 0)
    assert lease_lines(caplog) == []


async def test_a_late_pull_poisons_decodes_prefix_cache_for_that_prompt() -> None:
    """vLLM caches the blocks a pull filled (scheduler: _update_waiting_for_remote_kv → cache_blocks), so
    a later request on that decode sharing the prompt's full blocks reads the stale KV too."""
    async with handed_off() as (_, decode, alone, remote):
        decode.stall(LEASE_S + 2)
        await tokens(decode, SimRequest("r", PROMPT, 8, remote=remote))
        again = await tokens(decode, SimRequest("again", PROMPT, 8))  # no PD: decode alone, cache hit
        other = tuple(range(7000, 7040))
        unrelated = await tokens(decode, SimRequest("other", other, 8))
        assert again != await tokens(alone, SimRequest("x", PROMPT, 8))
        assert unrelated == await tokens(alone, SimRequest("y", other, 8))
        assert decode.stats.num_stale_reads == 2


async def test_heartbeats_stop_once_the_pull_is_done() -> None:
    async with handed_off() as (prefill, decode, _, remote):
        clock = decode.clock
        await tokens(decode, SimRequest("r", PROMPT, 4, remote=remote))
        held = await handoff(prefill, "kept")  # nobody pulls it: its lease must run out on time
        await clock.sleep(LEASE_S + 0.5)
        assert prefill.stats.num_kv_expired == 1
        assert held.request_id == "kept"


# --- The bookkeeping alone (leases.py) ------------------------------------------------------------------


def test_decode_heartbeats_each_holder_at_most_every_sixth_of_the_lease() -> None:
    reader = ReaderLeases(LEASE_S)
    reader.add("a", RemoteKV("p1", "ra", (1,), 16, "h1", 1))
    reader.add("b", RemoteKV("p2", "rb", (2,), 16, "h2", 2))
    reader.add("c", RemoteKV("p1", "rc", (3,), 16, "h1", 1))
    assert reader.due(10.0) == [("p1", "h1", 1, ("ra", "rc")), ("p2", "h2", 2, ("rb",))]
    assert reader.due(10.5) == []  # 6 // 6 = 1 s between heartbeats
    reader.done("a")
    reader.done("b")
    assert reader.due(11.0) == [("p1", "h1", 1, ("rc",))]
    reader.done("c")
    assert reader.next_due(0.1) is None and reader.due(20.0) == []


def test_prefill_reads_heartbeats_before_reads_and_counts_reads_of_released_holds() -> None:
    scheduler = Scheduler(PROFILE, "prefill")
    holder = HolderLeases(LEASE_S)
    scheduler.held["r"] = HeldKV((), 40, expires_at=1.0, num_cached_tokens=0)
    holder.notify(("heartbeat", ("r", "gone")))
    assert holder.read(scheduler, now=0.5) == [] and scheduler.held["r"].expires_at == 0.5 + 4.0
    holder.notify(("read", ("r",)))
    holder.notify(("read", ("r",)))  # a second read of the same hold: the blocks went back already
    assert holder.read(scheduler, now=0.6) == ["r"]
    assert (holder.num_late_reads, "r" in scheduler.held) == (1, False)
