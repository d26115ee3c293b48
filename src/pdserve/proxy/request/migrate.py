"""A stream that outlives its decode: when decode dies, stalls past its gap limit or breaks its stream
after the client has tokens, the answer goes on from another instance instead of ending in an error.

The continuation is the original prompt plus every token id the client was sent (ids, not text: the
model sees exactly the tokens it produced, so the text goes on where it stopped), prefilled again and
decoded through a continuation plan's own steps (split prefill→decode, or whole on one instance, as the router
and the survivor rules choose; the failed decode avoided), with ``max_tokens`` less what was sent. Its
events reach the client through a ``Seam`` (seam.py): the client's stream goes on, same id and shape, no
error, no gap, no repeat; stop strings, logprobs and usage are carried across.

Which streams may migrate (``why_not``): only those whose answer the seam cannot change. A greedy answer
goes on exactly as it would have; an unseeded sampled one is drawn from the same distribution given the
text so far. Not: ``n``/``best_of`` > 1, beam search, echo and prompt logprobs (one stream's ids do not
say all that was sent), presence or frequency penalties (vLLM counts those over the generated tokens
only, which the continuation would see as prompt), a seed with sampling (the seed's draws restart:
the answer would differ from the one the seed promises), structured output, tools, bad words, logits
processors, chat logprobs. Those keep today's behaviour: an error event ends the stream.

Costs on the common path: a streamed request that may migrate asks decode for ``return_token_ids`` and
its chunks pass ``Progress.feed`` (progress.py), a byte search and slice; everything else happens only
when a migration does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from pdserve import sse
from pdserve.configparts import Retries
from pdserve.errors import UpstreamDiverged, UpstreamError, UpstreamSuspectAnswer, UpstreamUnavailable
from pdserve.protocol import PATHS, Endpoint
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.request.plan import Plan
from pdserve.proxy.request.progress import Progress, events, first_choice
from pdserve.proxy.request.seam import Resumed, Seam, SeamEnded, StopText
from pdserve.proxy.request.steps import Call

log = logging.getLogger("pdserve.proxy")

Serve = Callable[[Plan], Awaitable[None]]  # the flow's steps of a plan (flow.py)

# Sampling fields a continuation (a completions request of token ids) carries over from the client's.
_CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop_token_ids",
            "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "logit_bias",
            "allowed_token_ids", "cache_salt", "priority", "user", "return_tokens_as_token_ids",
            "vllm_xargs")  # fmt: skip
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
               "bad_words", "logits_processors")  # fmt: skip


class CannotMigrate(Exception):
    """This stream cannot go on elsewhere; the message says why (the client gets today's error)."""


# Every field a reason not to migrate reads or that changes how a stream is followed, but the prompt: a
# body with none of these and a text prompt (or messages) is the common case, told apart in one set test.
_WATCHED = frozenset(("n", "best_of", "use_beam_search", "echo", "prompt_logprobs", "prompt_embeds",
                      "presence_penalty", "frequency_penalty", "seed", "response_format", "tools", "logprobs",
                      "return_token_ids", "stop", *_STRUCTURED))  # fmt: skip


def why_not(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """Why a stream with this body may not migrate, or None when it may."""
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and value > 1:
            return f"{field} > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("echo") or body.get("prompt_logprobs") is not None:
        return "echo or prompt logprobs"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return "batched prompts"
    if body.get("prompt_embeds") is not None:
        return "prompt embeddings"
    for field in ("presence_penalty", "frequency_penalty"):
        if body.get(field):
            return f"{field} (counted over generated tokens only)"
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "a seed with sampling (its draws would restart)"
    if any(body.get(field) for field in _STRUCTURED):
        return "structured output, bad words or logits processors"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "structured output"
    if endpoint == "chat" and (body.get("tools") or body.get("logprobs")):
        return "chat with tools or logprobs"
    return None


class Migrator:
    def __init__(self, state: ProxyState, config: Retries, decode_s: float) -> None:
        self._state = state
        self._max = config.max_migrations if config.migrate_streams else 0
        self._decode_s = decode_s

    def watch(
        self, endpoint: Endpoint, body: dict[str, Any], is_stream: bool
    ) -> tuple[dict[str, Any], Progress | None]:
        """The body decode gets and the ``Progress`` that follows the stream, for a stream that may
        migrate; otherwise ``body`` as it is and None (nothing on the stream's path)."""
        if not is_stream or not self._max:
            return body, None
        if body.keys().isdisjoint(_WATCHED) and not isinstance(body.get("prompt"), list):  # most bodies
            return {**body, "return_token_ids": True}, Progress(show_ids=False, keep_chunks=False)
        if why_not(endpoint, body) is not None:
            return body, None
        shows_ids = body.get("return_token_ids") is True
        keep = bool(body.get("stop")) or body.get("logprobs") is not None
        progress = Progress(show_ids=shows_ids, keep_chunks=keep)
        return (body if shows_ids else {**body, "return_token_ids": True}), progress

    async def resume(self, plan: Plan, failure: UpstreamError, serve: Serve) -> UpstreamError | None:
        """Continue the stream of ``plan``'s request after ``failure`` broke it; None once the client's
        stream has ended well, else the failure to tell the client (the last one). What each
        migration came to goes into the request's record through its plan."""
        call = plan.call
        out = call.out
        if not out.started or out.finished or failure.phase != "decode" or not call.is_stream:
            return failure
        if isinstance(failure, UpstreamSuspectAnswer):
            return failure  # what was sent may rest on wrong KV: nothing to continue from
        progress = call.progress
        if progress is None:
            reason = "migration is off" if not self._max else why_not(call.endpoint, call.body)
            plan.migrated("ineligible", {"reason": reason or "not watched", "from": failure.url})
            return failure
        avoid: list[Instance] = []
        for n in range(1, self._max + 1):
            failed = self._state.find(failure.url)
            # a decode that drew another first token is sound, and holds the prompt's KV in its cache
            if failed is not None and failed not in avoid and not isinstance(failure, UpstreamDiverged):
                avoid.append(failed)
            record: dict[str, Any] = {"from": failure.url, "after_tokens": len(progress.token_ids),
                                      "why": failure.detail}  # fmt: skip
            log.warning("request %s: decode %s failed mid-stream (%s); continuing elsewhere (%d of %d)",
                        call.request_id, failure.url, failure.detail, n, self._max)  # fmt: skip
            try:
                next_failure, to = await self._once(plan, progress, serve, avoid)
            except CannotMigrate as exc:
                plan.migrated("ineligible", {**record, "reason": str(exc)})
                return failure
            except UpstreamError as exc:
                plan.migrated("failed", {**record, "reason": exc.detail})
                return _carried(failure, exc)
            if next_failure is None:
                plan.migrated("ok", {**record, "to": to})
                return None
            plan.migrated("broken", {**record, "to": to, "reason": next_failure.detail})
            failure = next_failure
        self._state.stats.migrated("exhausted")
        return UpstreamUnavailable(failure.phase, failure.url,
                                   f"{failure.detail} (after {self._max} migrations)")  # fmt: skip

    async def _once(
        self, plan: Plan, progress: Progress, serve: Serve, avoid: list[Instance]
    ) -> tuple[UpstreamError | None, str | None]:
        """One continuation: None when the client's stream ended well, an error when it broke again
        after the continuation began; and the decode it went to. Raises when it could not begin."""
        call = plan.call
        resumed, stops, body = await self._continuation(call, progress, avoid)
        seam = Seam(call.out, resumed, progress, stops)
        if body is None:  # the answer was complete already: only its end was lost
            await seam.chunk(sse.DONE)
            await seam.end()
            return None, plan.decode_url
        cont = plan.continuation(call._replace(endpoint="completions", path=PATHS["completions"], body=body, out=seam,
                                               progress=None),
                                 avoid)  # fmt: skip
        try:
            await serve(cont)
        except SeamEnded:
            return None, cont.decode_url
        except UpstreamError as exc:
            if seam.started and not seam.is_done:
                return exc, cont.decode_url  # the continuation broke in turn: another migration may follow
            raise
        finally:
            cont.continuation_ended()
        if seam.rejected is not None:
            raise UpstreamUnavailable("decode", cont.decode_url or "-", f"continuation {seam.rejected}")
        if not call.out.finished:
            await seam.end()
        return None, cont.decode_url

    async def _continuation(
        self, call: Call, progress: Progress, avoid: Sequence[Instance]
    ) -> tuple[Resumed, StopText, dict[str, Any] | None]:
        """What the client has, its stop-string state, and the continuation's body (None: complete)."""
        prompt_ids = progress.prompt_ids
        if prompt_ids is None or progress.first is None:
            raise CannotMigrate("decode sent no token ids (return_token_ids)")
        sent = progress.token_ids
        body = call.body
        template, finished = _template(progress)
        delta = (template.get("choices") or [{}])[0].get("delta")
        if call.endpoint == "chat" and isinstance(delta, dict) and set(delta) - {"role", "content"}:
            raise CannotMigrate("chat deltas beyond content (reasoning or tool calls)")
        options = body.get("stream_options") or {}
        kept = events(b"".join(progress.kept)) if progress.kept is not None else []
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if isinstance(s, str) and s]
        include = body.get("include_stop_str_in_output") is True
        text_sent = "".join(_text(call.endpoint, e) for e in kept)
        text = text_sent
        if stops and not include and not finished:
            text = await self._detokenize(call, sent, avoid)
            if not text.startswith(text_sent):
                raise CannotMigrate("the answer's text does not extend what the client has")
        resumed = Resumed(
            endpoint=call.endpoint, template=template, num_prompt_tokens=len(prompt_ids), num_sent=len(sent),
            text=text, num_chars_sent=len(text_sent), next_text_offset=_next_offset(kept),
            show_ids=progress.shows_ids, include_usage=bool(options.get("include_usage")),
            continuous_usage=bool(options.get("continuous_usage_stats")),
        )  # fmt: skip
        min_tokens = body.get("min_tokens") or 0
        stop_text = StopText(stops, include, min_tokens, text, len(text_sent))
        budget = body.get("max_completion_tokens") or body.get("max_tokens")
        if finished or (isinstance(budget, int) and budget <= len(sent)):
            return resumed, stop_text, None
        cont = {k: body[k] for k in _CARRIED if k in body}
        cont.update(prompt=prompt_ids + sent, stream=True, return_token_ids=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": resumed.continuous_usage})  # fmt: skip
        if isinstance(budget, int):
            cont["max_tokens"] = budget - len(sent)
        if min_tokens:
            cont["min_tokens"] = max(0, min_tokens - len(sent))
        if call.endpoint == "completions" and body.get("logprobs") is not None:
            cont["logprobs"] = body["logprobs"]
        return resumed, stop_text, cont

    async def _detokenize(self, call: Call, ids: list[int], avoid: Sequence[Instance]) -> str:
        """The whole answer's text so far, held-back part included, from an instance's tokenizer."""
        payload = orjson.dumps({"model": call.body.get("model"), "tokens": ids})
        for instance in self._state.instances:
            if instance in avoid or not instance.is_available(time.monotonic()):
                continue
            limit = call.limit("decode", instance.url, self._decode_s)
            reply = await instance.upstream.post("/detokenize", payload, call.headers, "decode", limit,
                                                 is_repeatable=True)  # fmt: skip
            text = orjson.loads(reply.body).get("prompt") if reply.status == 200 else None
            if isinstance(text, str):
                return text
        raise CannotMigrate("no instance could detokenize the answer so far")


def _carried(first: UpstreamError, last: UpstreamError) -> UpstreamError:
    """The error the client reads when a continuation could not begin: the first failure, and why not."""
    return type(first)(first.phase, first.url, f"{first.detail}; could not continue elsewhere: {last.detail}")


def _template(progress: Progress) -> tuple[dict[str, Any], bool]:
    """The last token event the client got (or the first event), and whether it finished the answer."""
    source = progress.last_tokens or progress.first or b""
    found = [e for e in events(source) if first_choice(e) is not None]
    if not found:
        raise CannotMigrate("no event to continue from")
    last = found[-1]
    choice = first_choice(last)
    return last, choice is not None and choice.get("finish_reason") is not None


def _text(endpoint: Endpoint, event: dict[str, Any]) -> str:
    choice = first_choice(event)
    if choice is None:
        return ""
    if endpoint == "chat":
        delta = choice.get("delta")
        return (delta.get("content") or "") if isinstance(delta, dict) else ""
    return choice.get("text") or ""


def _next_offset(kept: list[dict[str, Any]]) -> int:
    """Completions logprobs: where the next token's text begins (vLLM's ``next_text_offsets``)."""
    for event in reversed(kept):
        logprobs = (first_choice(event) or {}).get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("tokens"):
            return int(logprobs["text_offset"][-1]) + len(logprobs["tokens"][-1])
    return 0
