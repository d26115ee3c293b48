"""The proxy's own HTTP/1.1 client (connection.py behind upstream.py), against scripted raw servers:
keep-alive reuse, the pool limit, bodies of every framing, gap limits, and connections that break."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from pdserve.errors import UpstreamConnectError, UpstreamStaleConnection, UpstreamTimeout, UpstreamUnavailable
from pdserve.proxy.wire.upstream import HTTPUpstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def whole(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)  # fmt: skip


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class Server:
    """A raw server that counts connections and requests; ``answer`` scripts each reply."""

    def __init__(self, answer: Callable[[int], bytes | None]) -> None:
        self.answer = answer  # request number → raw answer, or None: close without one
        self.num_connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                self.requests.append(await read_request(reader))
                raw = self.answer(len(self.requests))
                if raw is None:
                    break
                writer.write(raw)
                await writer.drain()
                if b"connection: close" in raw:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def serving(handler: Handler, max_connections: int = 4) -> AsyncIterator[HTTPUpstream]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = HTTPUpstream("decode", f"http://127.0.0.1:{port}", 1.0, max_connections)
    await upstream.open()
    try:
        yield upstream
    finally:
        await upstream.close()
        server.close()


async def test_sequential_calls_reuse_one_kept_alive_connection() -> None:
    server = Server(lambda n: whole(b'{"n":%d}' % n))
    async with serving(server.handle) as upstream:
        replies = [
            await upstream.post("/v1/completions", b"{}", {"X-Request-Id": "r"}, "decode", 2)
            for _ in range(3)
        ]
    assert [r.body for r in replies] == [b'{"n":1}', b'{"n":2}', b'{"n":3}']
    assert server.num_connections == 1
    assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"X-Request-Id: r\r\n" in server.requests[0] and server.requests[0].endswith(b"\r\n\r\n{}")


async def test_an_answer_asking_to_close_is_not_reused() -> None:
    server = Server(lambda n: whole(b"{}", b"connection: close\r\n"))
    async with serving(server.handle) as upstream:
        for _ in range(2):
            assert (await upstream.get("/health", "health", 2)).status == 200
    assert server.num_connections == 2


async def test_a_kept_alive_connection_the_instance_closed_is_retried_when_repeatable() -> None:
    # The first connection answers once, then closes on the next request without a word.
    server = Server(lambda n: None if n == 2 else whole(b"{}"))
    async with serving(server.handle) as upstream:
        await upstream.post("/p", b"{}", {}, "prefill", 2, is_repeatable=True)
        reply = await upstream.post("/p", b"{}", {}, "prefill", 2, is_repeatable=True)
    assert reply.status == 200 and server.num_connections == 2


async def test_a_stale_connection_is_not_retried_when_sending_twice_could_matter() -> None:
    server = Server(lambda n: None if n == 2 else whole(b"{}"))
    async with serving(server.handle) as upstream:
        await upstream.post("/d", b"{}", {}, "decode", 2)
        with pytest.raises(UpstreamUnavailable, match="closed before the answer was complete"):
            await upstream.post("/d", b"{}", {}, "decode", 2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_kept_alive_connection_closed_before_any_answer_says_so(stream: bool) -> None:
    # The flow asks the same decode once more for such a failure (flow.py); a new connection that
    # breaks is the instance's own failure, not a stale one.
    server = Server(lambda n: None if n >= 2 else whole(b"{}"))
    async with serving(server.handle) as upstream:
        await upstream.post("/d", b"{}", {}, "decode", 2)
        for expected in (UpstreamStaleConnection, UpstreamUnavailable):
            with pytest.raises(UpstreamUnavailable) as caught:
                if stream:
                    async with upstream.open_stream("/d", b"{}", {}, "decode", 2):
                        pass
                else:
                    await upstream.post("/d", b"{}", {}, "decode", 2)
            assert type(caught.value) is expected


async def test_chunked_and_read_until_close_bodies_arrive_whole() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    until_close = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nto the end"
    server = Server(lambda n: chunked if n == 1 else until_close)
    async with serving(server.handle) as upstream:
        first = await upstream.get("/a", "health", 2)
        second = await upstream.get("/b", "health", 2)
    assert (first.body, first.content_type) == (b"abcde", "application/json")  # the default type
    assert second.body == b"to the end"


async def test_a_stream_yields_chunks_as_they_come_and_stops_at_its_end() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for event in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with serving(handler) as upstream, upstream.open_stream("/s", b"{}", {}, "decode", 2) as stream:
        assert (stream.status, stream.content_type) == (200, "text/event-stream")
        chunks = [chunk async for chunk in stream.chunks(2, 2)]
    assert b"".join(chunks) == b"data: 1\n\ndata: [DONE]\n\n"


async def test_a_gap_longer_than_the_idle_limit_is_a_timeout_quoting_that_limit() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nfirs\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with serving(handler) as upstream, upstream.open_stream("/s", b"{}", {}, "decode", 2) as stream:
        seen = []
        with pytest.raises(UpstreamTimeout, match=r"within 0\.2 s"):
            async for chunk in stream.chunks(2, 0.2):
                seen.append(chunk)
    assert seen == [b"firs"]


async def test_an_instance_dying_mid_answer_is_unavailable_not_a_short_answer() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async with serving(handler) as upstream:
        with pytest.raises(UpstreamUnavailable, match="closed before the answer was complete"):
            await upstream.post("/d", b"{}", {}, "decode", 2)


async def test_waiting_for_a_free_connection_ends_at_the_calls_limit() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)  # holds the only connection

    async with serving(handler, max_connections=1) as upstream:
        first = asyncio.ensure_future(upstream.post("/d", b"{}", {}, "decode", 5))
        await asyncio.sleep(0.1)
        with pytest.raises(UpstreamTimeout, match=r"within 0\.3 s"):
            await upstream.post("/d", b"{}", {}, "decode", 0.3)
        first.cancel()
        # The cancelled call gave its connection back (closed): the next one gets a fresh slot.
        with pytest.raises(UpstreamTimeout):
            await upstream.post("/d", b"{}", {}, "decode", 0.2)


async def test_nothing_listening_is_a_connect_error() -> None:
    upstream = HTTPUpstream("prefill", "http://127.0.0.1:9", 1.0, 4)
    await upstream.open()
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await upstream.post("/p", b"{}", {}, "prefill", 2, is_repeatable=True)
    await upstream.close()


async def test_a_header_value_with_a_line_break_is_refused() -> None:
    server = Server(lambda n: whole(b"{}"))
    async with serving(server.handle) as upstream:
        with pytest.raises(ValueError, match="line break"):
            await upstream.post("/d", b"{}", {"X-Request-Id": "a\r\nEvil: 1"}, "decode", 2)
    assert server.requests == []
