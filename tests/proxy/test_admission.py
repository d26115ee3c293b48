from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from pdserve.proxy.serving.admission import Admission, Overloaded


@asynccontextmanager
async def _slot(admission: Admission) -> AsyncIterator[None]:
    """A slot held for the block, taken and given back as the proxy's generation route does."""
    if not admission.try_acquire():
        await admission.acquire()
    try:
        yield
    finally:
        admission.release()


async def test_requests_beyond_the_limit_wait_in_order_and_run_when_a_slot_frees() -> None:
    admission = Admission(max_concurrent=1, max_queued=2, queue_timeout_s=5)
    order: list[str] = []
    release_first = asyncio.Event()

    async def request(name: str, hold: asyncio.Event | None = None) -> None:
        async with _slot(admission):
            order.append(name)
            if hold:
                await hold.wait()

    first = asyncio.create_task(request("a", release_first))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(request(n)) for n in ("b", "c")]
    await asyncio.sleep(0)
    assert (admission.num_running, admission.num_queued) == (1, 2)
    release_first.set()
    await asyncio.gather(first, *queued)
    assert order == ["a", "b", "c"]
    assert (admission.num_running, admission.num_queued) == (0, 0)


async def _second_request_refused(admission: Admission) -> tuple[Overloaded, int]:
    """While a first request holds the only slot, a second one asks for a slot and is refused: the
    refusal, and how many requests were queued right after it (the first still running)."""
    async with _slot(admission):
        with pytest.raises(Overloaded) as info:
            async with _slot(admission):
                pass
        num_queued = admission.num_queued
    return info.value, num_queued


async def test_a_full_queue_refuses_at_once_with_429_and_retry_after() -> None:
    admission = Admission(max_concurrent=1, max_queued=0, queue_timeout_s=5)
    refused, _ = await _second_request_refused(admission)
    assert refused.status == 429 and refused.retry_after_s >= 1


async def test_waiting_past_the_queue_timeout_is_a_503_and_frees_the_queue_place() -> None:
    admission = Admission(max_concurrent=1, max_queued=1, queue_timeout_s=0.05)
    refused, num_queued = await _second_request_refused(admission)
    assert num_queued == 0
    assert refused.status == 503
    assert admission.num_running == 0


async def test_a_cancelled_waiter_does_not_leak_a_slot() -> None:
    admission = Admission(max_concurrent=1, max_queued=1, queue_timeout_s=5)
    hold = asyncio.Event()

    async def holder() -> None:
        async with _slot(admission):
            await hold.wait()

    running = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiting = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiting.cancel()
    hold.set()
    await running
    await asyncio.gather(waiting, return_exceptions=True)
    assert (admission.num_running, admission.num_queued) == (0, 0)


async def test_no_limit_means_no_queueing() -> None:
    admission = Admission(max_concurrent=None, max_queued=0, queue_timeout_s=1)
    async with _slot(admission), _slot(admission):
        assert admission.num_running == 2
