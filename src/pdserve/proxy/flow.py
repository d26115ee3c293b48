"""A request's path through the proxy, top to bottom.

    parse → pick prefill → prefill (max_tokens=1, do_remote_decode) → read kv_transfer_params
          → pick decode → decode (client's own request + params; decode pulls the KV over NIXL)
          → relay decode's answer to the client

The KV cache never passes through here: only its address (``kv_transfer_params``) does. Every way a
call can fail ends the client's request with an error naming the phase and instance; vLLM's own
rejections (4xx, 5xx) reach the client with vLLM's status and body.

Retries, before the client has received a byte:
- prefill fails (connect, timeout, 5xx, no params) → another prefill instance, with backoff; when all
  attempts fail, decode computes the prompt itself if ``fallback_to_local_prefill`` is on.
- decode fails before its first token → another decode instance. Prefill's params are reused only when
  the failed decode never received them (connect error) and are younger than the lease: a decode that
  did receive them may have pulled the blocks, which prefill then frees, and a second pull of freed
  blocks is not detected by vLLM (observed on 0.32: it "succeeds" and reads whatever is there).
Once the client has bytes, a failure ends the stream with an error event; nothing is retried.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from pdserve import protocol
from pdserve.config import ProxyConfig
from pdserve.errors import (
    NoInstanceAvailable,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamUnavailable,
)
from pdserve.protocol import SSE_DONE_MARK, SSE_ERROR_MARK, BadRequest, Endpoint
from pdserve.proxy.asgi import Responder
from pdserve.proxy.ledger import Handoff, Ledger
from pdserve.proxy.pool import Instance, Pool
from pdserve.proxy.prefix import block_hashes, should_skip_prefill, wants_prompt_tokens
from pdserve.proxy.routing import Policy
from pdserve.proxy.tokens import PromptTokenizer
from pdserve.proxy.trace import Trace, outcome
from pdserve.proxy.upstream import Reply, StreamReply

log = logging.getLogger("pdserve.proxy")

_MARK_TAIL = max(len(SSE_DONE_MARK), len(SSE_ERROR_MARK))


class _Answered(enum.Enum):
    """The client already has its answer (an instance's own rejection was relayed)."""

    YES = enum.auto()


@dataclass(frozen=True)
class Prompt:
    """What the proxy knows of a request's prompt, for prompt-aware routing and the skip rule."""

    num_tokens: int
    hashes: list[int]  # chained hashes of its full KV blocks (prefix.py)


class Flow:
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        prefill_policy: Policy,
        decode_policy: Policy,
        config: ProxyConfig,
        tokenizer: PromptTokenizer | None = None,
        num_traces: int = 256,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._config = config
        self._tokenizer = tokenizer
        self._t = config.timeouts
        self.traces: deque[Trace] = deque(maxlen=num_traces)
        self.ledger = Ledger(config.kv_lease_s)
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (endpoint, outcome) → requests
        self.retries: Counter[str] = Counter()  # phase → retried attempts

    async def serve(self, endpoint: Endpoint, raw: bytes, auth: str | None, out: Responder) -> None:
        try:
            body = protocol.client_body(protocol.parse_body(raw))
        except BadRequest as exc:
            await out.error(400, exc.message, "BadRequestError", exc.param)
            self.outcomes[(endpoint, "client_error")] += 1
            return
        trace = Trace(out.request_id, endpoint, stream=body.get("stream") is True)
        self.traces.append(trace)
        headers = {"X-Request-Id": out.request_id}
        if auth is not None:
            headers["Authorization"] = auth
        begun = time.perf_counter()
        try:
            await self._serve(endpoint, body, headers, trace, out)
        except UpstreamError as exc:
            trace.error = str(exc)
            log.warning("request %s failed: %s", out.request_id, exc)
            await out.error(exc.status, str(exc), exc.error_type)
        finally:
            trace.total_ms = (time.perf_counter() - begun) * 1000
            if not out.finished and trace.error is None:
                trace.error = "client disconnected"
            self.outcomes[(endpoint, outcome(trace, out.status))] += 1
            for retry in trace.retries:
                self.retries[retry.split(" ", 1)[0]] += 1
            if trace.handoff is not None:  # still open: decode never started answering
                kind = "client_gone" if trace.error == "client disconnected" else "failed"
                self.ledger.abandon(trace.handoff, trace.error or "request ended", kind)

    async def _serve(
        self, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str], trace: Trace, out: Responder
    ) -> None:
        path = protocol.PATHS[endpoint]
        trace.local_prefill_reason = protocol.needs_local_prefill(body)
        prompt = self._prompt(body)
        tried: list[Instance] = []
        for attempt in range(1, self._config.max_decode_attempts + 1):
            # Decode is chosen first: what it already caches decides whether prefill is worth a hop.
            decode, num_cached = self._pick_decode(tried, prompt)
            tried.append(decode)
            if attempt == 1 and trace.local_prefill_reason is None and prompt is not None:
                threshold = self._config.skip_prefill_below_tokens
                if should_skip_prefill(prompt.num_tokens, num_cached, threshold):
                    uncached = prompt.num_tokens - num_cached
                    trace.local_prefill_reason = f"{uncached} uncached prompt tokens < {threshold}"
            if trace.local_prefill_reason is None and trace.handoff is None:
                result = await self._prefill(path, body, headers, trace, out, prompt)
                if result is _Answered.YES:
                    return
                trace.handoff = result  # None: prefill gave up and decode computes the prompt itself
            handoff = trace.handoff
            # A retry goes to another instance: none left (or no attempts left) makes this the last.
            is_last = attempt == self._config.max_decode_attempts or not self.decode.available(tried)
            request = protocol.decode_body(body, handoff.params) if handoff else body
            try:
                failed = await self._decode(path, request, headers, decode, trace, out, is_last)
            except UpstreamError as exc:
                if out.started or is_last:
                    raise
                failure: UpstreamError | Reply = exc
            else:
                if failed is None:
                    return
                if is_last:
                    await _relay_rejection("decode", decode.url, failed, trace, out)
                    return
                failure = failed
            trace.retries.append(f"decode {decode.url}: {_describe(failure)}")
            is_unused = isinstance(failure, UpstreamConnectError)
            if handoff is not None and not (is_unused and handoff.is_fresh()):
                self.ledger.abandon(handoff, f"decode {decode.url}: {_describe(failure)}", "decode_failed")
                trace.handoff = None  # decode may have pulled, and prefill freed, those blocks: prefill again
            await asyncio.sleep(self._backoff(attempt))

    def forget_cache(self, instance: Instance) -> None:
        """What prompt-aware policies remember of ``instance``'s prefix cache no longer holds."""
        for policy in (self._prefill_policy, self._decode_policy):
            if wants_prompt_tokens(policy):
                policy.index.forget(instance.url)

    def _prompt(self, body: dict[str, Any]) -> Prompt | None:
        """The prompt's tokens and block hashes, when a policy or the skip rule needs them."""
        wants = wants_prompt_tokens(self._prefill_policy) or wants_prompt_tokens(self._decode_policy)
        if self._tokenizer is None or not (wants or self._config.skip_prefill_below_tokens):
            return None
        ids = self._tokenizer.token_ids(body)
        if ids is None:
            return None
        salt = body.get("cache_salt")
        hashes = block_hashes(ids, self._config.prefix_block_size, salt if isinstance(salt, str) else None)
        return Prompt(len(ids), hashes)

    def _candidates(self, pool: Pool, tried: Sequence[Instance], phase: str) -> list[Instance]:
        candidates = pool.available(exclude=tried)
        if not candidates:
            states = ", ".join(f"{i.url} ({_why_unavailable(i)})" for i in pool.instances)
            raise NoInstanceAvailable(phase, states or "none configured")
        return candidates

    def _pick_prefill(self, tried: Sequence[Instance], prompt: Prompt | None) -> Instance:
        candidates = self._candidates(self.prefill, tried, "prefill")
        policy = self._prefill_policy
        if prompt is not None and wants_prompt_tokens(policy):
            return policy.choose_for(candidates, prompt.hashes)
        return policy.choose(candidates)

    def _pick_decode(self, tried: Sequence[Instance], prompt: Prompt | None) -> tuple[Instance, int]:
        """A decode instance and how many of the prompt's tokens it likely holds in its prefix cache."""
        candidates = self._candidates(self.decode, tried, "decode")
        policy = self._decode_policy
        if prompt is not None and wants_prompt_tokens(policy):
            return policy.choose_with_hit(candidates, prompt.hashes)
        return policy.choose(candidates), 0

    def _backoff(self, attempt: int) -> float:
        return float(min(1.0, self._config.retry_backoff_s * 2 ** (attempt - 1)))

    async def _prefill(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        trace: Trace,
        out: Responder,
        prompt: Prompt | None,
    ) -> Handoff | _Answered | None:
        """Prefill's params; None when every attempt failed and decode should prefill locally."""
        payload = orjson.dumps(protocol.prefill_body(body))
        tried: list[Instance] = []
        failure: UpstreamError | Reply | None = None
        for attempt in range(1, self._config.max_prefill_attempts + 1):
            if attempt > 1:
                if not self.prefill.available(tried):
                    break  # a retry goes to another instance, and there is none
                await asyncio.sleep(self._backoff(attempt - 1))
            prefill = self._pick_prefill(tried, prompt)
            tried.append(prefill)
            trace.prefill_url = prefill.url
            begun = time.perf_counter()
            try:
                with prefill.dispatched():
                    reply = await prefill.upstream.post(path, payload, headers, "prefill", self._t.prefill)
                trace.prefill_ms = (time.perf_counter() - begun) * 1000
                trace.prefill_status = reply.status
                if reply.status == 200:
                    try:
                        params = protocol.kv_params_from_prefill(reply.body)
                    except ValueError as exc:
                        raise UpstreamProtocolError("prefill", prefill.url, str(exc)) from None
                    prefill.succeeded()
                    trace.kv_transfer_params = params
                    return self.ledger.open(out.request_id, prefill.url, params)
                if reply.status < 500:  # the client's own mistake: no other instance would differ
                    prefill.succeeded()
                    await _relay_rejection("prefill", prefill.url, reply, trace, out)
                    return _Answered.YES
                prefill.failed(f"answered {reply.status}")
                failure = reply
            except UpstreamError as exc:
                prefill.failed(exc.detail)
                failure = exc
            trace.retries.append(f"prefill {prefill.url}: {_describe(failure)}")
        if self._config.fallback_to_local_prefill:
            trace.local_prefill_reason = f"prefill failed ({trace.retries[-1]}); decode computes the prompt"
            log.warning("request %s: %s", out.request_id, trace.local_prefill_reason)
            return None
        if isinstance(failure, Reply):
            await _relay_rejection("prefill", trace.prefill_url or "-", failure, trace, out)
            return _Answered.YES
        assert failure is not None
        raise failure

    async def _decode(
        self,
        path: str,
        request: dict[str, Any],
        headers: dict[str, str],
        decode: Instance,
        trace: Trace,
        out: Responder,
        is_last: bool,
    ) -> Reply | None:
        """Serve the client from ``decode``; a 5xx (or a stream that fails first thing) is returned
        unrelayed while another attempt may still follow."""
        trace.decode_url = decode.url
        payload = orjson.dumps(request)
        upstream = decode.upstream
        with decode.dispatched():
            try:
                if not trace.stream:
                    reply = await upstream.post(path, payload, headers, "decode", self._t.decode)
                    trace.decode_status = reply.status
                    if reply.status >= 500:
                        decode.failed(f"answered {reply.status}")
                        return reply
                    decode.succeeded()
                    self._close_handoff(trace, decode, reply.status)
                    if reply.status != 200:
                        await _relay_rejection("decode", decode.url, reply, trace, out)
                    else:
                        await out.whole(
                            200, reply.content_type, protocol.without_transfer_metadata(reply.body)
                        )
                    return None
                # The first chunk's budget is what the status line left of first_token, not a fresh one.
                first_chunk_deadline = time.monotonic() + self._t.first_token
                async with upstream.open_stream(
                    path, payload, headers, "decode", self._t.first_token
                ) as resp:
                    trace.decode_status = resp.status
                    if resp.status != 200:
                        failed = Reply(resp.status, resp.content_type, await resp.read_all(self._t.idle))
                        if resp.status >= 500:
                            decode.failed(f"answered {resp.status}")
                            return failed
                        decode.succeeded()
                        self._close_handoff(trace, decode, resp.status)
                        await _relay_rejection("decode", decode.url, failed, trace, out)
                        return None
                    failed_first = await self._relay(
                        resp, decode, max(0.0, first_chunk_deadline - time.monotonic()), trace, out, is_last
                    )
                    if failed_first is None and not trace.stream_error_event:
                        decode.succeeded()
                    else:
                        decode.failed("streamed an error event")
                    return failed_first
            except UpstreamError as exc:
                decode.failed(exc.detail)
                raise

    async def _relay(
        self,
        resp: StreamReply,
        decode: Instance,
        first_timeout: float,
        trace: Trace,
        out: Responder,
        is_last: bool,
    ) -> Reply | None:
        """Forward decode's SSE bytes untouched, watching only for vLLM's error event and [DONE].

        The client's stream starts with the first chunk, not before: an error event as the very
        first thing (e.g. the KV pull failed) can still be retried elsewhere unless this is the last try.
        """
        # Markers include the blank line that ends the previous event: JSON strings cannot hold a raw
        # newline, so a token's text can never fake one. The stream's start counts as an event boundary.
        tail = b"\n\n"
        is_done = False
        async for chunk in resp.chunks(first_timeout, self._t.idle, self._t.first_token):
            window = tail + chunk  # markers may straddle chunks
            is_error = SSE_ERROR_MARK in window
            if not out.started:
                if is_error and not is_last:
                    return Reply(200, resp.content_type, chunk)
                await out.start_stream(resp.content_type)
                self._close_handoff(trace, decode, 200)
            if is_error:
                # vLLM's event says only what failed; the client also learns where (error path only).
                chunk = protocol.with_error_event_origin(chunk, f"decode instance {decode.url}")
                if not trace.stream_error_event:
                    trace.stream_error_event = True
                    trace.error = "decode streamed an error event"
                    log.warning("request %s: decode %s streamed an error event", out.request_id, decode.url)
            await out.chunk(chunk)
            if SSE_DONE_MARK in window:
                is_done = True
            tail = window[-_MARK_TAIL:]
        if not is_done:
            # A stream that stops without [DONE] would look like a short answer to the client.
            raise UpstreamUnavailable("decode", decode.url, "stream ended before it was complete")
        await out.end()
        return None

    def _close_handoff(self, trace: Trace, decode: Instance, status: int) -> None:
        """Decode answered: its first bytes mean it has the KV; a 4xx means vLLM refused the request
        and the KV waits on prefill until its lease runs out."""
        if trace.handoff is None:
            return
        if status == 200:
            self.ledger.delivered(trace.handoff, decode.url)
        else:
            self.ledger.abandon(trace.handoff, f"decode {decode.url} answered {status}", "decode_rejected")
        trace.handoff = None


def _describe(failure: UpstreamError | Reply | None) -> str:
    if isinstance(failure, Reply):
        return "streamed an error event first" if failure.status == 200 else f"answered {failure.status}"
    return failure.detail if failure is not None else "-"


def _why_unavailable(instance: Instance) -> str:
    if instance.is_draining:
        return "draining"
    if not instance.is_healthy:
        return f"unhealthy: {instance.last_error}"
    return f"circuit {instance.breaker.state(time.monotonic())}"


async def _relay_rejection(phase: str, url: str, reply: Reply, trace: Trace, out: Responder) -> None:
    """An instance's non-200 answer goes to the client with its status; a 5xx also names who failed."""
    trace.error = f"{phase} answered {reply.status}"
    body = reply.body
    if reply.status >= 500:
        body = protocol.with_error_origin(body, f"{phase} instance {url}")
    await out.whole(reply.status, reply.content_type, body)
