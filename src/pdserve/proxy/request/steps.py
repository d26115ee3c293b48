"""A request's steps and what each comes to: the shapes the plan (plan.py) hands the flow and the
performers (prefill.py, decode.py) hand back.

The plan answers "what next?" with a step: ``WaitForDecode`` (hold the request at the proxy until its
decode can pull the KV within prefill's lease: proxy/pool/backpressure.py), ``PrefillStep`` (one
prefill call on a named instance), ``DecodeStep`` (decode serves the client, with the handoff's params
or computing the prompt itself), ``Backoff`` (wait before the next attempt), ``Release`` (decode refused
a handoff: have it pull and drop the KV, in the background) or ``GiveUp`` (the client hears of the last
failure). A prefill call comes to ``Prefilled`` (its params), ``Relayed`` (the client already has
vLLM's own rejection), or an ``UpstreamError``/5xx ``Reply``; a decode attempt to ``Served``,
``DecodeFailed`` (before the client got a byte) or ``LeaseSuspect`` (its answer withheld by the lease
guard). Performers return these and write nothing about the request: the plan reads them and writes the
record.

``Call`` is the request as every step sees it, read-only: the plan makes a new one when the body must
change (a fresh ``cache_salt``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdserve import protocol
from pdserve.errors import UpstreamError, UpstreamTimeout
from pdserve.protocol import Endpoint
from pdserve.proxy.kv.ledger import Handoff
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.routing import Prompt
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.request.progress import Progress
from pdserve.proxy.wire.upstream import Reply


class Call(NamedTuple):
    """One client request as the attempts see it; nothing here changes while an attempt runs (a tuple:
    read-only, and built in a fraction of a frozen dataclass's time, once per request)."""

    endpoint: Endpoint
    body: dict[str, Any]  # the client's body, kv_transfer_params removed (a lease retry's has a new salt)
    headers: dict[str, str]  # for both instances: X-Request-Id, Authorization
    out: Responder  # the client's answer, and what it was told went wrong
    is_stream: bool
    deadline: float  # monotonic: the request's overall limit (Timeouts.request)
    request_s: float  # that limit, for the messages that name it
    path: str  # the endpoint's path on an instance (``protocol.PATHS``), read by every attempt
    prompt: Prompt | None = None
    progress: Progress | None = None  # what a stream that may migrate has sent (migrate.py)

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


class WaitForDecode(NamedTuple):
    """Before a prefill round: wait until ``decode`` has room to pull the KV well within prefill's lease
    (proxy/pool/backpressure.py), within the wait's limit and the request's deadline."""

    call: Call
    decode: Instance


class PrefillStep(NamedTuple):
    """One prefill call: ``payload`` (the body rewritten to one token with ``do_remote_decode``) to
    ``instance``."""

    call: Call
    instance: Instance
    payload: bytes


class Backoff(NamedTuple):
    """Wait this long (within the request's deadline) before the next attempt."""

    seconds: float


class Release(NamedTuple):
    """Decode refused the request whose KV ``handoff`` pins on prefill: have it pull and drop the KV
    (release.py), beside the client's answer."""

    call: Call
    decode: Instance
    handoff: Handoff


class GiveUp(NamedTuple):
    """The last attempt of ``phase`` failed: the client hears of ``failure`` (raised, or relayed)."""

    phase: str
    url: str
    failure: UpstreamError | Reply


class Prefilled(NamedTuple):
    url: str  # the prefill instance that holds the KV
    params: dict[str, Any]  # its kv_transfer_params, verbatim
    num_kv_expired: float | None  # its count of leases run out unpulled, as last scraped (guard.py)
    # its whole answer, parsed: the first token a stream may send at once (firsttoken.py)
    answer: Mapping[str, Any] | None = None


class Relayed(NamedTuple):
    """The client already has its answer: an instance's own rejection, relayed."""

    status: int


@dataclass(frozen=True)
class PrefillFailed:
    failure: UpstreamError | Reply  # the last attempt's error, or its 5xx answer
    url: str = "-"  # the instance that failed last ("-": none could be tried)


class Served(NamedTuple):
    """The client got decode's answer (or decode's own 4xx: ``status``)."""

    status: int


SERVED = Served(200)  # the common answer, made once: a stream or a whole answer that went out well


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


async def relay_rejection(phase: str, url: str, reply: Reply, out: Responder) -> None:
    """An instance's non-200 answer goes to the client with its status; a 5xx also names who failed."""
    body = reply.body
    if reply.status >= 500:
        body = protocol.with_error_origin(body, f"{phase} instance {url}")
    await out.relay(reply.status, reply.content_type, body, failure=f"{phase} answered {reply.status}")
