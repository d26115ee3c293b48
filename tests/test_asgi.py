"""The ASGI plumbing the proxy and the simulator share, driven in-process with scripted messages."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

from asgi_rig import Recorder
from pdserve.asgi import ResponseWriter, header, read_body, run_until_disconnect
from pdserve.errors import BodyTooLarge, ClientGone


def scripted(messages: Iterable[dict[str, Any]], then_wait: bool = True) -> Any:
    """A ``receive`` that hands out ``messages``, then blocks (a client still connected) or disconnects."""
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        if then_wait:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


async def test_body_is_joined_from_its_parts() -> None:
    receive = scripted([{"type": "http.request", "body": b"ab", "more_body": True},
                        {"type": "http.request", "body": b"c"}])  # fmt: skip
    assert await read_body(receive, 10) == b"abc"


async def test_a_body_over_the_limit_is_refused_and_a_hang_up_is_noticed() -> None:
    with pytest.raises(BodyTooLarge):
        await read_body(scripted([{"type": "http.request", "body": b"x" * 11}]), 10)
    with pytest.raises(ClientGone):
        await read_body(scripted([{"type": "http.disconnect"}]), 10)


def test_header_lookup_is_by_lower_case_name() -> None:
    scope = {"headers": [(b"x-request-id", b"abc"), (b"authorization", b"Bearer k")]}
    assert header(scope, b"x-request-id") == "abc"
    assert header(scope, b"missing") is None


async def test_writer_reports_how_far_the_answer_got() -> None:
    send = Recorder()
    out = ResponseWriter(send)
    await out.start_stream()
    assert (out.started, out.finished, out.status) == (True, False, 200)
    await out.chunk(b"data: 1\n\n")
    await out.end()
    assert out.finished and [m.get("more_body", False) for m in send.messages[1:]] == [True, False]
    whole = ResponseWriter(Recorder())
    await whole.whole(404, b"{}")
    assert whole.finished and whole.status == 404


async def test_a_client_that_hangs_up_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cancelled.set()

    out = ResponseWriter(Recorder())
    assert await run_until_disconnect(work(), scripted([], then_wait=False), out) is True
    assert cancelled.is_set()


async def test_a_hang_up_after_the_answer_is_complete_lets_the_work_finish() -> None:
    out = ResponseWriter(Recorder())
    finished = asyncio.Event()

    async def work() -> None:
        await out.whole(200, b"{}")
        await asyncio.sleep(0.05)  # bookkeeping after the last byte
        finished.set()

    assert await run_until_disconnect(work(), scripted([], then_wait=False), out) is False
    assert finished.is_set()
