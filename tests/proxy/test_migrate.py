"""A stream whose decode fails after the client has tokens goes on from another instance (migrate.py):
the client reads the answer it would have read without the failure, without an error, a repeat or a gap.

The instances are in-memory (token_engine.py): a greedy model whose next token depends on every token
before it, so a continuation from the wrong tokens, or from re-tokenized text, would read differently."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from memory_upstream import MemoryUpstream, Recorder, Script
from token_engine import dies_after, engine

from pdserve import sse
from pdserve.config import ProxyConfig, Role, Timeouts
from pdserve.configparts import Retries
from pdserve.errors import UpstreamTimeout, UpstreamUnavailable
from pdserve.protocol import Endpoint
from pdserve.proxy.pool.policies import make_policy
from pdserve.proxy.pool.state import Outcome, ProxyState
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.request.flow import Flow
from pdserve.proxy.serving.admission import Admission
from pdserve.proxy.serving.exposition import render

BROKEN = UpstreamUnavailable("decode", "http://d0:1", "connection closed before the answer was complete")
STALLED = UpstreamTimeout("decode", "http://d0:1", "no answer within 1 s")
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hello there", "max_tokens": 12, "temperature": 0,
                              "stream": True}  # fmt: skip
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                        "temperature": 0, "stream": True}  # fmt: skip


class System:
    """A proxy over scripted instances: prefill p0…, decode d0…"""

    def __init__(self, prefill: list[Script], decode: list[Script], **config: Any) -> None:
        urls: dict[Role, list[str]] = {
            "prefill": [f"http://p{i}:1" for i in range(len(prefill))],
            "decode": [f"http://d{i}:1" for i in range(len(decode))],
        }
        scripts = dict(zip(urls["prefill"] + urls["decode"], prefill + decode, strict=True))
        self.upstreams: dict[str, MemoryUpstream] = {}

        def make(role: Role, url: str) -> MemoryUpstream:
            self.upstreams[url] = MemoryUpstream(role, url, scripts[url])
            return self.upstreams[url]

        config.setdefault("retries", Retries(first_backoff_s=0))
        self.config = ProxyConfig.pd(urls["prefill"], urls["decode"], **{"timeouts": Timeouts(), **config})
        policies = {"prefill": make_policy("round_robin"), "decode": make_policy("round_robin")}
        self.state = ProxyState(self.config, policies, make)  # type: ignore[arg-type]
        self.flow = Flow(self.state, self.config)

    async def ask(self, body: dict[str, Any], endpoint: Endpoint = "completions") -> Recorder:
        send = Recorder()
        await self.flow.serve(endpoint, orjson.dumps(body), None, Responder(send, "r"))
        return send

    def calls(self, url: str) -> list[dict[str, Any]]:
        return [c.body for c in self.upstreams[url].calls]

    def metric(self, result: str) -> int:
        return self.state.stats.migrations[result]


def healthy() -> System:
    return System([engine("p0")], [engine("d0")])


def read(answer: Recorder) -> list[dict[str, Any]]:
    """The client's events ([DONE] as {"done": True}, an error event as it is)."""
    out = []
    for payload in sse.payloads(answer.body):
        out.append({"done": True} if payload == sse.DONE_PAYLOAD else orjson.loads(payload))
    return out


def text_of(events: list[dict[str, Any]]) -> str:
    parts = []
    for e in events:
        for c in e.get("choices") or []:
            parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def finish_of(events: list[dict[str, Any]]) -> tuple[Any, Any]:
    last = [c for e in events for c in e.get("choices") or [] if c.get("finish_reason")]
    assert len(last) == 1, events
    return last[0]["finish_reason"], last[0].get("stop_reason")


def assert_clean(events: list[dict[str, Any]]) -> None:
    """No error event, one [DONE] at the end, one stream id throughout, no token ids the client did not ask for."""
    assert not [e for e in events if "error" in e], events
    assert events[-1] == {"done": True} and sum(1 for e in events if e.get("done")) == 1
    assert len({e["id"] for e in events if "id" in e}) == 1
    for e in events:
        assert e.get("prompt_token_ids") is None
        for c in e.get("choices") or []:
            assert c.get("token_ids") is None and c.get("prompt_token_ids") is None


async def reference(body: dict[str, Any], endpoint: Endpoint = "completions") -> list[dict[str, Any]]:
    return read(await healthy().ask(body, endpoint))


@pytest.mark.parametrize("k", [1, 2, 5, 11])
@pytest.mark.parametrize("failure", [BROKEN, STALLED], ids=["dies", "stalls"])
async def test_a_stream_whose_decode_fails_after_k_tokens_reads_as_the_uninterrupted_one(
    k: int, failure: Exception
) -> None:
    system = System([engine("p0")], [engine("d0", breaks=dies_after(k, failure)), engine("d1")])
    answer = await system.ask(COMPLETION)
    events, expected = read(answer), await reference(COMPLETION)
    assert_clean(events)
    assert text_of(events) == text_of(expected) and finish_of(events) == finish_of(expected) == (
        "length",
        None,
    )
    [to_d1] = system.calls("http://d1:1")
    assert to_d1["max_tokens"] == 12 - k  # the budget less what the client had
    assert system.metric("ok") == 1
    assert system.state.stats.outcomes[("completions", Outcome.OK)] == 1


@pytest.mark.parametrize("k", [1, 4, 9])
async def test_a_chat_stream_goes_on_in_chat_chunks(k: int) -> None:
    system = System([engine("p0")], [engine("d0", breaks=dies_after(k + 1, BROKEN)), engine("d1")])
    events = read(await system.ask(CHAT, "chat"))
    expected = await reference(CHAT, "chat")
    assert_clean(events)
    assert text_of(events) == text_of(expected)
    assert all(e["object"] == "chat.completion.chunk" for e in events if "object" in e)
    [to_d1] = system.calls("http://d1:1")
    assert "messages" not in to_d1 and all(isinstance(t, int) for t in to_d1["prompt"])


async def test_the_continuation_is_the_prompt_and_the_ids_sent_not_retokenized_text() -> None:
    system = System([engine("p0")], [engine("d0", breaks=dies_after(3, BROKEN)), engine("d1")])
    await system.ask(COMPLETION)
    [to_d1] = system.calls("http://d1:1")
    reference_ids = [c["token_ids"] for e in read(await healthy().ask({**COMPLETION, "return_token_ids": True}))
                     for c in e.get("choices") or []]  # fmt: skip
    first_three = [t for ids in reference_ids[:3] for t in ids]
    assert to_d1["prompt"][-3:] == first_three
    assert "stop" not in to_d1 and to_d1["return_token_ids"] is True


async def test_a_stream_cut_without_its_end_goes_on() -> None:
    system = System([engine("p0")], [engine("d0", cut_after=4), engine("d1")])
    events = read(await system.ask(COMPLETION))
    assert_clean(events)
    assert text_of(events) == text_of(await reference(COMPLETION))


async def test_with_one_decode_the_prefill_instance_serves_the_continuation_whole() -> None:
    system = System([engine("p0")], [engine("d0", breaks=dies_after(5, BROKEN))])
    events = read(await system.ask(COMPLETION))
    assert_clean(events)
    assert text_of(events) == text_of(await reference(COMPLETION))
    streamed_by_p0 = [b for b in system.calls("http://p0:1") if b.get("stream")]
    assert len(streamed_by_p0) == 1  # the stand-in's whole answer


@pytest.mark.parametrize("k", [3, 4, 5, 6, 7])
async def test_a_stop_string_spanning_the_seam_ends_the_answer_where_the_uninterrupted_one_ends(
    k: int,
) -> None:
    plain = await reference(COMPLETION)
    full = text_of(plain)
    words = [c["text"] for e in plain for c in e.get("choices") or []]
    seam_at = len("".join(words[:5]))
    stop = full[seam_at - 2 : seam_at + 2]  # the end of the fifth token's text and the sixth's start
    body = {**COMPLETION, "stop": [stop, "zzz"]}
    expected = await reference(body)
    assert finish_of(expected) == ("stop", stop)  # the uninterrupted answer does stop there
    system = System([engine("p0")], [engine("d0", breaks=dies_after(k, BROKEN)), engine("d1")])
    events = read(await system.ask(body))
    assert_clean(events)
    assert text_of(events) == text_of(expected) == full[: seam_at - 2]
    assert finish_of(events) == ("stop", stop)


async def test_text_held_back_for_a_stop_string_reaches_the_client_after_the_seam() -> None:
    body = {**COMPLETION, "stop": ["never-seen"]}
    system = System([engine("p0")], [engine("d0", breaks=dies_after(6, BROKEN)), engine("d1")])
    events = read(await system.ask(body))
    assert_clean(events)
    assert text_of(events) == text_of(await reference(body))


async def test_usage_counts_the_original_prompt_and_every_token_across_the_seam() -> None:
    body = {**COMPLETION, "stream_options": {"include_usage": True}}
    system = System([engine("p0")], [engine("d0", breaks=dies_after(4, BROKEN)), engine("d1")])
    events = read(await system.ask(body))
    assert_clean(events)
    [usage] = [e["usage"] for e in events if e.get("usage")]
    [expected] = [e["usage"] for e in await reference(body) if e.get("usage")]
    assert usage == expected and usage["completion_tokens"] == 12


async def test_logprobs_go_on_across_the_seam_with_their_text_offsets() -> None:
    body = {**COMPLETION, "logprobs": 1}
    system = System([engine("p0")], [engine("d0", breaks=dies_after(5, BROKEN)), engine("d1")])
    events = read(await system.ask(body))

    def flat(evs: list[dict[str, Any]], key: str) -> list[Any]:
        return [
            v for e in evs for c in e.get("choices") or [] for v in (c.get("logprobs") or {}).get(key, [])
        ]

    expected = await reference(body)
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert flat(events, key) == flat(expected, key)


async def test_a_client_that_asked_for_token_ids_gets_every_one_once() -> None:
    body = {**COMPLETION, "return_token_ids": True}
    system = System([engine("p0")], [engine("d0", breaks=dies_after(5, BROKEN)), engine("d1")])
    events = read(await system.ask(body))
    ids = [t for e in events for c in e.get("choices") or [] for t in c.get("token_ids") or []]
    expected = [
        t for e in await reference(body) for c in e.get("choices") or [] for t in c.get("token_ids") or []
    ]
    assert ids == expected and len(ids) == 12


async def test_n_above_one_is_not_migrated_and_ends_with_an_error_event_as_before() -> None:
    body = {**COMPLETION, "n": 2}
    system = System([engine("p0")], [engine("d0", breaks=dies_after(3, BROKEN)), engine("d1")])
    events = read(await system.ask(body))
    assert "error" in events[-2] and events[-1] == {"done": True}
    assert system.calls("http://d1:1") == []
    assert system.metric("ineligible") == 1
    assert system.state.traces[-1].migrations[0]["reason"] == "n > 1"


async def test_a_seeded_sampled_stream_is_not_migrated() -> None:
    body = {**COMPLETION, "temperature": 0.8, "seed": 7}
    system = System([engine("p0")], [engine("d0", breaks=dies_after(3, BROKEN)), engine("d1")])
    events = read(await system.ask(body))
    assert "error" in events[-2]
    assert system.metric("ineligible") == 1


async def test_migration_off_keeps_todays_error_event_and_asks_decode_for_no_ids() -> None:
    system = System([engine("p0")], [engine("d0", breaks=dies_after(3, BROKEN)), engine("d1")],
                    retries=Retries(first_backoff_s=0, migrate_streams=False))  # fmt: skip
    events = read(await system.ask(COMPLETION))
    assert "error" in events[-2] and "connection closed" in events[-2]["error"]["message"]
    assert "return_token_ids" not in system.calls("http://d0:1")[0]


async def test_after_max_migrations_the_stream_ends_with_an_error_naming_them() -> None:
    always = [engine(f"d{i}", breaks=dies_after(2, BROKEN)) for i in range(4)]
    system = System([engine("p0")], always, retries=Retries(first_backoff_s=0, max_migrations=2))
    events = read(await system.ask(COMPLETION))
    assert "after 2 migrations" in events[-2]["error"]["message"]
    text = text_of(events)
    assert text == text_of(await reference(COMPLETION))[: len(text)]  # what came is right, in order
    assert system.metric("broken") == 2 and system.metric("exhausted") == 1
    assert 'pdserve_migrations_total{result="broken"} 2' in render(system.state, Admission(None, 0, 1.0))


async def test_the_deadline_bounds_the_continuation_and_the_error_says_so() -> None:
    slow = engine("d1")

    def late(body: dict[str, Any]) -> Any:
        answer = slow(body)
        return (
            answer
            if not isinstance(body.get("prompt"), list)
            else type(answer)(**{**answer.__dict__, "delay_s": 5})
        )

    system = System([engine("p0")], [engine("d0", breaks=dies_after(3, BROKEN)), late],
                    timeouts=Timeouts(request=0.5), retries=Retries(first_backoff_s=0, prefill_stands_in=False))  # fmt: skip
    events = read(await system.ask(COMPLETION))
    message = events[-2]["error"]["message"]
    assert "could not continue elsewhere" in message and "deadline" in message
    assert system.metric("failed") == 1


async def test_each_migration_shows_in_requests() -> None:
    system = System([engine("p0")], [engine("d0", breaks=dies_after(3, BROKEN)), engine("d1")])
    await system.ask(COMPLETION)
    [migration] = system.state.traces[-1].as_dict()["migrations"]
    assert (
        migration["result"] == "ok"
        and migration["from"] == "http://d0:1"
        and migration["to"] == "http://d1:1"
    )
    assert migration["after_tokens"] == 3


async def test_a_whole_request_whose_decode_fails_is_answered_as_if_nothing_happened() -> None:
    body = {**COMPLETION, "stream": False}
    system = System([engine("p0")], [engine("d0", whole_breaks=BROKEN), engine("d1")])
    answer = await system.ask(body)
    expected = await healthy().ask(body)
    assert answer.status == 200
    assert orjson.loads(answer.body)["choices"] == orjson.loads(expected.body)["choices"]
