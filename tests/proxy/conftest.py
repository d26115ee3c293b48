"""The proxy under test, started once per session in front of a fake prefill and a fake decode.

Every server (fakes and proxy) runs in its own thread and event loop, so the proxy runs as
``pdserve proxy`` does and the tests talk to it over sockets only.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator

import aiohttp
import openai
import pytest
from fake_vllm import FakeVLLM
from proxy_rig import CLIENT_TIMEOUT, STRICT, Rig, running_proxy, serve_fake


@pytest.fixture(scope="session")
def _session_rig() -> Iterator[Rig]:
    prefill, decode = FakeVLLM("prefill"), FakeVLLM("decode")
    with (
        serve_fake(prefill) as prefill_url,
        serve_fake(decode) as decode_url,
        # Each role's failures reach the client here: the tests of those paths need no survivor stepping in.
        running_proxy([prefill_url], [decode_url], retries=STRICT) as url,
    ):
        yield Rig(url, prefill, decode, prefill_url, decode_url)


@pytest.fixture
def rig(_session_rig: Rig) -> Rig:
    """The session's proxy and fakes, with the fakes' faults and records cleared."""
    _session_rig.prefill.reset()
    _session_rig.decode.reset()
    return _session_rig


@pytest.fixture
def dead_url() -> str:
    """A URL where nothing listens: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def client(rig: Rig) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=rig.url + "/v1", api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT
    ) as api:
        yield api


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as session:
        yield session
