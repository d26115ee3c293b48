"""One client request as its attempts see it (``Call``), and what an attempt can come to.

A prefill attempt: the KV is ready (``Prefilled``), the client already has vLLM's own rejection
(``Relayed``), or it failed (``PrefillFailed``). A decode attempt: the client was served (``Served``), it
failed before the client got a byte (``DecodeFailed``), or its answer was withheld by the lease guard
(``LeaseSuspect``). The flow (flow.py) and the decode relay (decode.py) share these, and the deadline
arithmetic every attempt obeys.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve import protocol
from pdserve.errors import UpstreamError, UpstreamTimeout
from pdserve.protocol import Endpoint
from pdserve.proxy.ledger import Handoff
from pdserve.proxy.responder import Responder
from pdserve.proxy.timeline import Timeline
from pdserve.proxy.trace import Trace
from pdserve.proxy.upstream import Reply


@dataclass(frozen=True)
class Prompt:
    """What the proxy knows of a request's prompt, for prompt-aware routing and the skip rule."""

    num_tokens: int
    hashes: list[int]  # chained hashes of its full KV blocks (blocks.py)


@dataclass
class Call:
    """One client request as the attempts see it."""

    endpoint: Endpoint
    body: dict[str, Any]  # the client's body, kv_transfer_params removed
    headers: dict[str, str]  # for both instances: X-Request-Id, Authorization
    out: Responder
    trace: Trace
    is_stream: bool
    deadline: float  # monotonic: the request's overall limit (Timeouts.request)
    request_s: float  # that limit, for the messages that name it
    prompt: Prompt | None = None
    handoff: Handoff | None = None  # the KV handoff in play: opened by prefill, closed by decode
    delivered: Handoff | None = None  # the handoff decode's answer rests on, once it began
    has_error_event: bool = False  # decode streamed vLLM's error event to the client
    error: str | None = None  # the error the client was given, if any (the Trace records a copy)
    timeline: Timeline = field(default_factory=lambda: Timeline(time.perf_counter()))

    @property
    def path(self) -> str:
        return protocol.PATHS[self.endpoint]

    @property
    def request_id(self) -> str:
        return self.out.request_id

    def limit(self, phase: str, url: str, limit: float) -> float:
        """The time an attempt may take: its phase's limit, or what is left of the request's deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise UpstreamTimeout(phase, url, f"the request's {self.request_s:g} s deadline passed")
        return min(limit, left)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(min(seconds, max(0.0, self.deadline - time.monotonic())))

    def timeout_cause(self, exc: UpstreamTimeout) -> UpstreamTimeout:
        """A timeout that the deadline, not the phase's own limit, caused says so."""
        if time.monotonic() >= self.deadline - 0.01:
            return UpstreamTimeout(exc.phase, exc.url, f"the request's {self.request_s:g} s deadline passed")
        return exc


@dataclass(frozen=True)
class Prefilled:
    handoff: Handoff


@dataclass(frozen=True)
class Relayed:
    """The client already has its answer: an instance's own rejection, relayed."""


@dataclass(frozen=True)
class PrefillFailed:
    failure: UpstreamError | Reply  # the last attempt's error, or its 5xx answer
    url: str = "-"  # the instance that failed last ("-": none could be tried)


@dataclass(frozen=True)
class Served:
    """The client got decode's answer (or decode's own 4xx)."""


@dataclass(frozen=True)
class DecodeFailed:
    failure: UpstreamError | Reply  # a 5xx answer, or a stream whose first event was an error
    kv_unused: bool = field(default=False)  # the request never reached decode: its params are unread
    is_stale: bool = False  # a kept-alive connection closed before any answer byte (UpstreamStaleConnection)


@dataclass(frozen=True)
class LeaseSuspect:
    """Decode answered, but its answer may rest on released KV (guard.py): withheld, prefill again."""

    why: str


def describe(failure: UpstreamError | Reply) -> str:
    if isinstance(failure, Reply):
        return "streamed an error event first" if failure.status == 200 else f"answered {failure.status}"
    return failure.detail


async def relay_rejection(phase: str, url: str, reply: Reply, call: Call) -> None:
    """An instance's non-200 answer goes to the client with its status; a 5xx also names who failed."""
    call.error = f"{phase} answered {reply.status}"
    body = reply.body
    if reply.status >= 500:
        body = protocol.with_error_origin(body, f"{phase} instance {url}")
    await call.out.relay(reply.status, reply.content_type, body)
