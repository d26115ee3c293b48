"""Overload control: at most N requests in flight, a bounded queue behind them, a bounded wait in it.

Beyond the queue a request is refused at once with 429; one that waited past the queue timeout gets
503. Both carry Retry-After, so well-behaved clients back off instead of hammering a saturated system,
and no request waits without bound for a slot that may never come.
"""

from __future__ import annotations

import asyncio
import collections

from pdserve.errors import Overloaded


class Admission:
    def __init__(self, max_concurrent: int | None, max_queued: int, queue_timeout_s: float) -> None:
        self.max_concurrent = max_concurrent  # None: no limit
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.num_running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.num_rejected = 0

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """A slot at once when one is free and nobody queues for one (no coroutine: the common case).
        Whoever holds a slot, from here or from ``acquire``, gives it back with ``release`` in a
        ``finally``: plain calls rather than a context manager, whose frames called from C cost a
        request more than the rest of its admission."""
        if self.max_concurrent is None or (self.num_running < self.max_concurrent and not self._waiters):
            self.num_running += 1
            return True
        return False

    async def acquire(self) -> None:
        """A slot, after a bounded wait in the queue; ``Overloaded`` (429 or 503) when none comes."""
        if self.try_acquire():
            return
        if len(self._waiters) >= self.max_queued:
            self.num_rejected += 1
            raise Overloaded(
                429,
                f"pdserve is at capacity ({self.num_running} running, {len(self._waiters)} queued); retry later",
                retry_after_s=1,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter  # release() hands its slot over: num_running is already counted for us
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot was handed over just as the timeout fired: keep it
            self.num_rejected += 1
            raise Overloaded(
                503, f"no capacity within the queue timeout ({self.queue_timeout_s:g} s); retry later",
                retry_after_s=max(1, round(self.queue_timeout_s)),
            ) from None  # fmt: skip
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed to us just as we were cancelled: pass it on
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; num_running is unchanged
                return
        self.num_running -= 1
