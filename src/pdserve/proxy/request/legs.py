"""Decode's leg sent before prefill has answered, and the upstream a decode attempt reads it through.

``EarlyLeg`` sends decode its request at once (push: decode registers blocks and waits for prefill's
WRITE) and keeps the connection until the decode attempt that adopts it is done. ``Adopted`` is what
that attempt (decode.py) calls instead of the instance's own upstream: the early leg's answer, or, with
no early leg, a request of its own; either way, with the first token cut out of the stream when the
client already has it (firsttoken.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from pdserve.errors import (
    UpstreamDiverged,
    UpstreamError,
    UpstreamSuspectAnswer,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.request.firsttoken import FirstTokenCut, FirstTokenMismatch
from pdserve.proxy.request.plan import DecodeStep
from pdserve.proxy.request.steps import Call
from pdserve.proxy.wire.upstream import Reply, Stream

if TYPE_CHECKING:
    from pdserve.config import Role


class EarlyLeg:
    """Decode's request, in flight from the moment it is made. It counts as open at its decode (routing's
    load, the supervisor's question whether a request there still waits for a push:
    ``Instance.hold_early``) until the decode attempt adopts it, which dispatches it from then on, or
    until it ends."""

    __slots__ = ("_answer", "_is_counted", "_released", "_task", "call", "decode")

    def __init__(self, call: Call, decode: Instance, payload: bytes) -> None:
        self.call = call
        self.decode = decode
        loop = asyncio.get_running_loop()
        self._answer: asyncio.Future[Stream | Reply] = loop.create_future()
        self._released = asyncio.Event()
        decode.hold_early()
        self._is_counted = True
        self._task = asyncio.create_task(self._send(payload))

    def uncount(self) -> None:
        """No longer counted here: the decode attempt took the request over (it counts it itself), or it ended."""
        if self._is_counted:
            self._is_counted = False
            self.decode.release_early()

    async def _send(self, payload: bytes) -> None:
        call, decode, answer = self.call, self.decode, self._answer
        try:
            # The leg's own limit: the stream's first chunk or the whole answer, prefill's time included.
            if call.is_stream:
                limit = call.limit("decode", decode.url, call.request_s)
                async with decode.upstream.open_stream(
                    call.path, payload, call.headers, "decode", limit
                ) as resp:
                    answer.set_result(resp)
                    await self._released.wait()  # leaving the block closes what the attempt did not read
            else:
                limit = call.limit("decode", decode.url, call.request_s)
                answer.set_result(
                    await decode.upstream.post(call.path, payload, call.headers, "decode", limit)
                )
        except UpstreamError as exc:
            if not answer.done():
                answer.set_exception(exc)
        finally:
            if not answer.done():
                answer.cancel()
            self.uncount()  # over at decode: no longer in flight there

    async def answer(self, timeout: float) -> Stream | Reply:
        """The leg's status line (a stream) or whole answer, within ``timeout``."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._answer), timeout)
        except TimeoutError:
            raise UpstreamTimeout("decode", self.decode.url,
                                  f"prefill's KV did not reach decode within {timeout:g} s (push)") from None  # fmt: skip
        except asyncio.CancelledError:
            if self._answer.cancelled():
                raise UpstreamUnavailable(
                    "decode", self.decode.url, "decode's early request was closed"
                ) from None
            raise

    def release(self) -> None:
        """The attempt is done with the answer: the connection may close (or go back to its pool)."""
        self._released.set()

    def close(self) -> None:
        """Nobody will read decode's answer: close its request (vLLM aborts it)."""
        self.uncount()  # the task may never have run: it would not count it out
        self._task.cancel()
        if self._answer.done() and not self._answer.cancelled():
            self._answer.exception()  # retrieved: a failure nobody reads is not logged as lost


class Adopted:
    """The upstream a decode attempt calls: the early leg's answer, or its own request to ``decode``;
    the client's first token cut out of a stream it already has."""

    def __init__(
        self,
        decode: Instance,
        leg: EarlyLeg | None,
        cut: FirstTokenCut | None,
        lease_s: float,
        step: DecodeStep,
    ) -> None:
        self._decode = decode
        self._leg = leg
        self._cut = cut
        self._lease_s = lease_s
        self._step = step  # the DecodeStep: told when the answer begins, when the client had prefill's token
        if leg is not None:
            leg.uncount()  # the attempt that calls this counts the request in flight from now on

    @property
    def role(self) -> Role:
        return self._decode.upstream.role

    @property
    def url(self) -> str:
        return self._decode.url

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get(self, path: str, phase: str, timeout: float) -> Reply:
        return await self._decode.upstream.get(path, phase, timeout)

    async def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        phase: str,
        timeout: float,
        is_repeatable: bool = False,
    ) -> Reply:
        leg = self._leg
        if leg is None:
            return await self._decode.upstream.post(path, body, headers, phase, timeout, is_repeatable)
        try:
            answer = await leg.answer(timeout)
        finally:
            leg.release()
        assert isinstance(answer, Reply)
        return answer

    @asynccontextmanager
    async def open_stream(
        self, path: str, body: bytes, headers: Mapping[str, str], phase: str, timeout: float
    ) -> AsyncIterator[Stream]:
        leg = self._leg
        if leg is None:
            async with self._decode.upstream.open_stream(path, body, headers, phase, timeout) as resp:
                yield self._wrap(resp)
            return
        try:
            # prefill has answered: the status line comes at once, the first chunk once the KV is written
            answer = await leg.answer(min(timeout, self._lease_s))
            assert not isinstance(answer, Reply)
            yield self._wrap(answer)
        finally:
            leg.release()

    def _wrap(self, resp: Stream) -> Stream:
        return resp if self._cut is None else _CutStream(resp, self._cut, self._decode.url, self._step)


class _CutStream:
    """Decode's stream less the first token the client already has (``FirstTokenCut``)."""

    def __init__(self, resp: Stream, cut: FirstTokenCut, url: str, step: DecodeStep) -> None:
        self._resp = resp
        self._cut = cut
        self._url = url
        self._step = step
        self.status = resp.status
        self.content_type = resp.content_type

    async def read_all(self, timeout: float) -> bytes:
        return await self._resp.read_all(timeout)

    async def chunks(
        self, first_timeout: float, idle_timeout: float, first_budget: float | None = None
    ) -> AsyncIterator[bytes]:
        step, is_first = self._step, True
        async for chunk in self._resp.chunks(first_timeout, idle_timeout, first_budget):
            if is_first:
                is_first = False
                # The client's stream began with prefill's token: the guard's verdict and the ledger's
                # "delivered" come with decode's first chunk instead.
                if (suspect := await step.trusted(time.perf_counter())) is not None:
                    # withheld, nothing of decode's answer went out: with the ids the client's tokens
                    # have, a migration goes on from them (its prompt computed anew, no KV pulled)
                    kind = UpstreamDiverged if self._cut.has_ids else UpstreamSuspectAnswer
                    raise kind("decode", self._url, f"KV lease: {suspect.why}")
                step.begins(200)
            try:
                out = self._cut.feed(chunk)
            except FirstTokenMismatch as exc:
                # what the client has may not go on as decode goes on: from prefill's token, when its ids
                # are known (a migration), else not at all
                kind = UpstreamDiverged if self._cut.has_ids else UpstreamSuspectAnswer
                raise kind("decode", self._url, str(exc)) from None
            if out:
                yield out
