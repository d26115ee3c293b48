"""One client request as its attempts see it (``Call``), the KV handoff it has in play
(``HandoffSlot``), and what an attempt can come to.

A prefill attempt: prefill's params are in (``Prefilled``), the client already has vLLM's own rejection
(``Relayed``), or it failed (``PrefillFailed``). A decode attempt: the client was served (``Served``), it
failed before the client got a byte (``DecodeFailed``), or its answer was withheld by the lease guard
(``LeaseSuspect``). The flow (flow.py) reads these and decides what comes next; the attempts
(prefill.py, decode.py) only report.

Who writes what of a request: the ``Call`` is read-only (the flow makes a new one when the body must
change); its handoff moves only through the ``HandoffSlot``, which the flow opens and checks at the end
and decode closes when its answer begins (delivered, refused or suspect); what the client was told goes
wrong is kept by the ``Responder`` that told it; the ``Trace`` and ``Timeline`` only record.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdserve import protocol
from pdserve.errors import UpstreamError, UpstreamTimeout
from pdserve.protocol import Endpoint
from pdserve.proxy.ledger import Handoff, Ledger
from pdserve.proxy.progress import Progress
from pdserve.proxy.record import Trace
from pdserve.proxy.responder import Responder
from pdserve.proxy.timeline import Timeline
from pdserve.proxy.upstream import Reply


@dataclass(frozen=True)
class Prompt:
    """What the proxy knows of a request's prompt, for prompt-aware routing and the skip rule."""

    num_tokens: int
    hashes: list[int]  # chained hashes of its full KV blocks (blocks.py)


class Call(NamedTuple):
    """One client request as the attempts see it; nothing here changes while an attempt runs (a tuple:
    read-only, and built in a fraction of a frozen dataclass's time, once per request)."""

    endpoint: Endpoint
    body: dict[str, Any]  # the client's body, kv_transfer_params removed (a lease retry's has a new salt)
    headers: dict[str, str]  # for both instances: X-Request-Id, Authorization
    out: Responder  # the client's answer, and what it was told went wrong
    trace: Trace  # a record for /requests: written as things happen, never read to decide
    is_stream: bool
    deadline: float  # monotonic: the request's overall limit (Timeouts.request)
    request_s: float  # that limit, for the messages that name it
    timeline: Timeline
    prompt: Prompt | None = None
    progress: Progress | None = None  # what a stream that may migrate has sent (migrate.py)

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


class HandoffSlot:
    """The KV handoff one request has in play, and the only writer of it in the ledger.

    Prefill's params open it (``open``); it closes once: delivered when decode's answer begins, abandoned
    (decode refused it, a retry may not reuse it), or suspect (the lease guard's verdict). ``finish``, at
    the request's end, abandons one still open, so that no handoff outlives its request unaccounted.
    """

    __slots__ = ("_ledger", "_request_id", "delivered", "handoff")

    def __init__(self, ledger: Ledger, request_id: str) -> None:
        self._ledger = ledger
        self._request_id = request_id
        self.handoff: Handoff | None = None  # open: its params go with the next decode attempt
        self.delivered: Handoff | None = None  # the one decode's answer rests on, once it began

    def open(self, prefilled: Prefilled) -> None:
        """Prefill's params are in: the KV is pinned under a lease from now on."""
        assert self.handoff is None, "a handoff is already in play"
        self.handoff = self._ledger.open(
            self._request_id, prefilled.url, prefilled.params, prefilled.num_kv_expired
        )

    def deliver(self, decode_url: str) -> None:
        """Decode's answer began: it has the KV."""
        if self.handoff is not None:
            self._ledger.delivered(self.handoff, decode_url)
            self.delivered, self.handoff = self.handoff, None

    def abandon(self, reason: str, kind: str) -> None:
        """No decode will read the open handoff's params; ``kind`` is the label the ledger counts."""
        if self.handoff is not None:
            self._ledger.abandon(self.handoff, reason, kind)
            self.handoff = None

    def suspect(self, kind: str, why: str) -> None:
        """The KV under the handoff in play (open, or delivered to a stream still going) may have been
        released before decode read it: the ledger marks it, and an open one is dropped with it."""
        handoff = self.handoff or self.delivered
        if handoff is not None:
            self._ledger.mark_suspect(handoff, kind, why)
            self.handoff = None

    def finish(self, reason: str, is_client_gone: bool) -> None:
        """The request is over: a handoff still open never reached a decode that answered."""
        self.abandon(reason, "client_gone" if is_client_gone else "failed")


class Prefilled(NamedTuple):
    url: str  # the prefill instance that holds the KV
    params: dict[str, Any]  # its kv_transfer_params, verbatim
    num_kv_expired: float | None  # its count of leases run out unpulled, as last scraped (guard.py)


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


async def relay_rejection(phase: str, url: str, reply: Reply, out: Responder) -> None:
    """An instance's non-200 answer goes to the client with its status; a 5xx also names who failed."""
    body = reply.body
    if reply.status >= 500:
        body = protocol.with_error_origin(body, f"{phase} instance {url}")
    await out.relay(reply.status, reply.content_type, body, failure=f"{phase} answered {reply.status}")
