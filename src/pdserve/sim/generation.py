"""One generation request through a sim instance, top to bottom, as vLLM answers it.

Read the body → check it like vLLM → draw a fault → hand the engine a ``SimRequest`` → stream SSE
chunks or build the whole answer → record metrics. (An instance that is "down" never gets here: api.py
closes its connections.) A client that hangs up cancels the work,
which closes the engine's generator, which aborts the request and frees its blocks (as in vLLM).

The streamed path is the throughput path: per token it does one deque pop in the engine, one
concatenation of pre-encoded bytes and one ``send``, plus a histogram observation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Final

import orjson

from pdserve import sse
from pdserve.asgi import (
    Receive,
    Scope,
    Send,
    header,
    read_body,
    run_until_disconnect,
)
from pdserve.errors import (
    BodyTooLarge,
    ClientGone,
    ConnectionDropped,
    EngineStoppedError,
    SimRequestError,
)
from pdserve.protocol import Endpoint, error_body
from pdserve.sim import logprobs, render, tokenizer
from pdserve.sim.faults import RequestFault
from pdserve.sim.replica import SimInstance
from pdserve.sim.request import GenerationRequest, parse_request
from pdserve.sim.types import SimRequest, TokenEvent
from pdserve.sim.wire import DISCONNECT_WAIT_S, Writer

log = logging.getLogger("pdserve.sim")

MAX_BODY_BYTES: Final = 64 * 1024 * 1024


def request_ids(endpoint: Endpoint, x_request_id: str | None, rand: random.Random) -> tuple[str, str]:
    """(response id, engine request id) as vLLM makes them; the engine id is prefill's remote_request_id."""

    def hex_digits(num: int) -> str:
        return f"{rand.getrandbits(4 * num):0{num}x}"

    base = x_request_id if x_request_id is not None else hex_digits(16)
    if endpoint == "completions":
        return f"cmpl-{base}", f"cmpl-{base}-0-{hex_digits(8)}"
    return f"chatcmpl-{base}", f"chatcmpl-{base}-{hex_digits(8)}"


class _Stop:
    """Stop strings over the generated text, with vLLM's hold-back: text that could still turn out to be
    the start of a stop string is not sent until it cannot."""

    __slots__ = ("_holdback", "_stops", "sent", "text")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._holdback = max(len(s) for s in stops) - 1
        self.text = ""
        self.sent = 0  # characters of text already released

    def add(self, piece: str) -> tuple[str, str | None]:
        """The text to release after ``piece``, and the stop string if one now appears."""
        start = max(0, len(self.text) - self._holdback)
        self.text += piece
        hits = [(i, s) for s in self._stops if (i := self.text.find(s, start)) != -1]
        if hits:
            end, stop = min(hits)
            return self._release(end), stop
        return self._release(max(self.sent, len(self.text) - self._holdback)), None

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


async def _fail(out: Writer) -> None:
    """vLLM's answer to an internal error: a 500, or an error event if the stream has begun."""
    if not out.started:
        await out.whole(500, render.INTERNAL_ERROR_BODY)
    elif not out.finished:
        await out.end(render.STREAM_INTERNAL_ERROR + sse.DONE)


@dataclass(frozen=True)
class _Answer:
    """One request being answered: what the client asked, under which ids, where to, since when."""

    req: GenerationRequest
    response_id: str
    sim_req: SimRequest  # what the engine runs
    out: Writer
    t0: float  # time.perf_counter() at arrival: TTFT and E2E count from here
    drop_after: int  # tokens streamed before an injected drop cuts the connection; -1: no drop


class GenerationEndpoint:
    """The ASGI app of ``POST /v1/completions`` or ``POST /v1/chat/completions`` for one instance."""

    def __init__(self, instance: SimInstance, endpoint: Endpoint) -> None:
        self._inst = instance
        self._endpoint = endpoint
        # Unseeded, as vLLM's random_uuid is: nothing may rely on ids repeating from run to run (the
        # faults' RNG is the seeded one).
        self._rand = random.Random()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        inst = self._inst
        out = Writer(send)
        try:
            raw = await read_body(receive, MAX_BODY_BYTES)
        except ClientGone:
            return
        except BodyTooLarge:
            await out.whole(413, error_body("Request body too large", "BadRequestError", 413))
            return
        arrival = time.perf_counter()
        try:
            req = parse_request(self._endpoint, raw, header(scope, b"content-type"), inst.profile)
        except SimRequestError as exc:
            await out.whole(exc.status, error_body(exc.message, exc.err_type, exc.status, exc.param))
            return
        response_id, engine_request_id = request_ids(
            self._endpoint, header(scope, b"x-request-id"), self._rand
        )
        work = self._serve(req, response_id, engine_request_id, out, arrival)
        try:
            await run_until_disconnect(work, receive, out, lambda: out.dropped, DISCONNECT_WAIT_S)
        except ConnectionDropped:
            raise  # the server closes the connection: an injected fault, not a failure
        except Exception:
            log.exception("sim %s: request %s failed", inst.engine_id, response_id)
            await _fail(out)

    async def _serve(
        self, req: GenerationRequest, response_id: str, engine_id: str, out: Writer, t0: float
    ) -> None:
        inst = self._inst
        fault = inst.faults.draw_request_fault()
        if fault is RequestFault.ERROR:
            await out.whole(500, render.INTERNAL_ERROR_BODY)
            return
        if fault is RequestFault.HANG:
            await asyncio.get_running_loop().create_future()  # until the client gives up
        sim_req = SimRequest(
            engine_id, req.prompt_token_ids, req.max_tokens, req.is_prefill, req.remote, req.seed,
            req.cache_salt, req.logprobs,
        )  # fmt: skip
        try:
            inst.engine.check_request(sim_req)
        except ValueError as exc:
            await out.whole(400, error_body(str(exc), "BadRequestError", 400))
            return
        cut = self._inst.faults.spec.drop_after_tokens or max(1, req.max_tokens // 2)
        drop_after = cut if fault is RequestFault.DROP else -1
        answer = _Answer(req, response_id, sim_req, out, t0, drop_after)
        reason = "abort"
        try:
            reason = await (self._stream(answer) if req.stream else self._whole(answer))
        except EngineStoppedError as exc:  # the instance is shutting down, or "crashed" (restart)
            log.info("sim %s: request %s ended: %s", inst.engine_id, response_id, exc)
            reason = "error"
            if inst.is_restarting:
                out.drop()  # a process that dies answers nothing more: the connection is cut
                return
            await _fail(out)
        finally:
            inst.metrics.record_finish(reason)
            if reason in ("length", "stop"):
                inst.metrics.e2e.observe(time.perf_counter() - t0)

    async def _stream(self, answer: _Answer) -> str:
        req, out, t0 = answer.req, answer.out, answer.t0
        inst, metrics = self._inst, self._inst.metrics
        fmt = render.StreamFormat(
            req.endpoint,
            answer.response_id,
            int(time.time()),
            inst.model_name,
            inst.system_fingerprint,
            req.include_usage,
            req.prompt_token_ids if req.return_token_ids else None,
            req.tokens_as_ids,
        )
        delay = inst.faults.spec.token_delay_s
        stop = _Stop(req.stop) if req.stop else None
        piece_json = tokenizer.piece_json
        await out.start_stream()
        num_tokens, last, cached = 0, t0, 0
        async with aclosing(inst.engine.generate(answer.sim_req)) as events:
            async for event in events:
                if num_tokens == 0:
                    cached = event.num_cached_tokens
                if event.finish_reason == "error":  # the KV pull failed: vLLM's 200 + error event
                    await out.end(
                        fmt.role_chunk * (num_tokens == 0) + render.STREAM_INTERNAL_ERROR + sse.DONE
                    )
                    return "error"
                if delay:
                    await asyncio.sleep(delay)
                now = time.perf_counter()
                if num_tokens:
                    metrics.itl.observe(now - last)
                    head = b""
                else:
                    metrics.ttft.observe(now - t0)
                    head = fmt.role_chunk
                last = now
                num_tokens += 1
                finish, stop_reason = event.finish_reason, None
                if stop is None:
                    text_json = piece_json(event.token_id)
                else:
                    text, stop_reason = stop.add(tokenizer.piece(event.token_id))
                    if stop_reason is not None:
                        finish = "stop"
                        self._release_unreported(event, answer.sim_req.request_id)
                    elif finish is not None:
                        text += stop.flush()
                    text_json = orjson.dumps(text)
                logprob = None
                if req.logprobs and event.logprob is not None:
                    logprob = self._noisy(event.logprob)
                if finish is None:
                    await out.chunk(head + fmt.token(text_json, event.token_id, logprob))
                    if num_tokens == answer.drop_after:
                        out.drop()
                        return "abort"
                    continue
                tail = b""
                if req.include_usage:
                    tail = fmt.usage(len(req.prompt_token_ids), num_tokens, self._cached_tokens(req, cached))
                await out.end(
                    head
                    + fmt.final(text_json, finish, stop_reason, event.token_id, logprob)
                    + tail
                    + sse.DONE
                )
                return finish
        return "abort"  # the engine ended the stream without a finish reason (stopped)

    def _cached_tokens(self, req: GenerationRequest, cached: int) -> int | None:
        """vLLM's prompt_tokens_details.cached_tokens: only with --enable-prompt-tokens-details; a
        ``remote_prefill_cached_tokens`` in the params replaces the instance's own count (vLLM's front end
        reports prefill's hits for a decode handed them)."""
        if not self._inst.profile.prompt_tokens_details:
            return None
        return cached if req.prefill_cached_tokens is None else req.prefill_cached_tokens

    def _noisy(self, value: float) -> float:
        noise = self._inst.faults.spec.logprob_noise
        return min(0.0, value + self._rand.uniform(-noise, noise)) if noise else value

    def _details(
        self, req: GenerationRequest, token_ids: list[int], token_logprobs: list[float], cached: int
    ) -> render.Details:
        prompt_lps = None
        if req.prompt_logprobs:
            prompt_lps = tuple(
                None if lp is None else self._noisy(lp)
                for lp in logprobs.prompt_logprobs(req.prompt_token_ids)
            )
        return render.Details(
            req.prompt_token_ids, tuple(token_ids), tuple(token_logprobs) if req.logprobs else None,
            prompt_lps, req.return_token_ids, req.tokens_as_ids, self._cached_tokens(req, cached),
        )  # fmt: skip

    def _release_unreported(self, event: TokenEvent, request_id: str) -> None:
        """A prefill that ends on a stop string gets no kv_transfer_params from vLLM (NixlConnector
        hands its KV over only when the request ended by length), and its blocks are freed at once."""
        if event.held is not None:
            self._inst.engine.release_unsent(request_id)

    async def _whole(self, answer: _Answer) -> str:
        req, out, t0 = answer.req, answer.out, answer.t0
        inst, metrics = self._inst, self._inst.metrics
        delay = inst.faults.spec.token_delay_s
        stop = _Stop(req.stop) if req.stop else None
        token_ids: list[int] = []
        token_logprobs: list[float] = []
        cached = 0
        final: TokenEvent | None = None
        finish, stop_reason, last = "abort", None, t0
        async with aclosing(inst.engine.generate(answer.sim_req)) as events:
            async for event in events:
                if event.finish_reason == "error":
                    await out.whole(500, render.INTERNAL_ERROR_BODY)
                    return "error"
                if delay:
                    await asyncio.sleep(delay)
                now = time.perf_counter()
                (metrics.itl if token_ids else metrics.ttft).observe(now - (last if token_ids else t0))
                last = now
                if not token_ids:
                    cached = event.num_cached_tokens
                token_ids.append(event.token_id)
                if event.logprob is not None:
                    token_logprobs.append(self._noisy(event.logprob))
                if stop is not None:
                    stop_reason = stop.add(tokenizer.piece(event.token_id))[1]
                    if stop_reason is not None:
                        finish = "stop"
                        self._release_unreported(event, answer.sim_req.request_id)
                        break
                if event.finish_reason is not None:
                    final, finish = event, event.finish_reason
                    break
        if stop is not None:
            text = stop.text[: stop.sent] if stop_reason is not None else stop.text
        else:
            text = tokenizer.decode(token_ids)
        kv_params = None
        if req.is_prefill and final is not None and final.held is not None:
            kv_params = render.kv_transfer_params(
                final.held,
                inst.engine_id,
                inst.host,
                inst.port,
                answer.sim_req.request_id,
                inst.profile.tensor_parallel_size,
            )
        body = render.whole_answer(
            req.endpoint, answer.response_id, int(time.time()), inst.model_name, inst.system_fingerprint, text,
            finish, stop_reason, len(req.prompt_token_ids), len(token_ids), kv_params,
            self._details(req, token_ids, token_logprobs, cached),
        )  # fmt: skip
        if answer.drop_after >= 0:  # a whole answer is cut halfway through its body
            await out.partial(200, body, len(body) // 2)
            out.drop()
            return "abort"
        await out.whole(200, body)
        return finish
