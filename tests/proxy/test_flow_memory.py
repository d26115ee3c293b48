"""The request path with in-memory instances (memory_upstream.py): what each attempt sends and what the
client gets, without sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from memory_upstream import Answer, MemoryUpstream, Recorder, Script

from pdserve import sse
from pdserve.config import ProxyConfig, Role, Timeouts
from pdserve.configparts import PoolSpec, Retries
from pdserve.errors import UpstreamConnectError, UpstreamStaleConnection, UpstreamUnavailable
from pdserve.events import InstanceEvent
from pdserve.proxy.pool.policies import make_policy
from pdserve.proxy.pool.state import Outcome, ProxyState
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.request.flow import Flow

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e0",
          "remote_request_id": "cmpl-r-0-00000000", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}  # fmt: skip
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 5}


def prefill_ok(body: dict[str, Any]) -> Answer:
    return Answer(body=orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}))


def decode_text(text: str) -> Script:
    def answer(body: dict[str, Any]) -> Answer:
        if body.get("stream"):
            chunk = sse.event(orjson.dumps({"choices": [{"text": text}]}))
            return Answer(chunks=[chunk, sse.DONE], content_type="text/event-stream")
        return Answer(body=orjson.dumps({"choices": [{"text": text}], "kv_transfer_params": None}))

    return answer


def failing(exc: Exception) -> Script:
    def answer(body: dict[str, Any]) -> Answer:
        raise exc

    return answer


class System:
    """A proxy state and flow over scripted prefill and decode instances."""

    def __init__(
        self, prefill: list[Script], decode: list[Script], colocated: bool = False, **config: Any
    ) -> None:
        """``colocated``: a proxy with a decode pool alone, which serves each request whole."""
        urls: dict[Role, list[str]] = {
            "prefill": [f"http://p{i}:1" for i in range(len(prefill))],
            "decode": [f"http://d{i}:1" for i in range(len(decode))],
        }
        # Instances that join later (a move, the admin API) need a script here first.
        self.scripts = dict(zip(urls["prefill"] + urls["decode"], prefill + decode, strict=True))
        self.upstreams: dict[str, MemoryUpstream] = {}

        def make(role: Role, url: str) -> MemoryUpstream:
            self.upstreams[url] = MemoryUpstream(role, url, self.scripts[url])
            return self.upstreams[url]

        settings = {"timeouts": Timeouts(), "retries": Retries(first_backoff_s=0), **config}
        roles: tuple[Role, ...] = ("decode",) if colocated else ("prefill", "decode")
        config_ = ProxyConfig(pools=tuple(PoolSpec(role, tuple(urls[role])) for role in roles), **settings)
        policies = {"prefill": make_policy("round_robin"), "decode": make_policy("round_robin")}
        self.state = ProxyState(config_, policies, make)  # type: ignore[arg-type]
        self.flow = Flow(self.state, config_)

    async def ask(self, body: dict[str, Any]) -> Recorder:
        send = Recorder()
        await self.flow.serve("completions", orjson.dumps(body), None, Responder(send, "r"))
        return send

    def calls(self, url: str) -> list[dict[str, Any]]:
        return [c.body for c in self.upstreams[url].calls]


async def test_prefill_gets_one_token_and_decode_the_clients_own_request_with_prefills_params() -> None:
    system = System([prefill_ok], [decode_text(" world")])
    answer = await system.ask(COMPLETION)
    assert answer.status == 200
    assert orjson.loads(answer.body) == {"choices": [{"text": " world"}]}
    [to_prefill] = system.calls("http://p0:1")
    assert to_prefill["max_tokens"] == 1 and to_prefill["kv_transfer_params"]["do_remote_decode"] is True
    [to_decode] = system.calls("http://d0:1")
    assert to_decode == {**COMPLETION, "kv_transfer_params": PARAMS}
    assert system.state.stats.outcomes[("completions", Outcome.OK)] == 1
    assert system.state.ledger.num_delivered == 1


async def test_a_decode_that_never_got_the_params_hands_them_to_the_next_one() -> None:
    unreachable = failing(UpstreamConnectError("decode", "http://d0:1", "cannot connect"))
    system = System([prefill_ok], [unreachable, decode_text(" ok")])
    answer = await system.ask(COMPLETION)
    assert answer.status == 200
    assert len(system.calls("http://p0:1")) == 1  # no second prefill: the KV was never read
    assert system.calls("http://d1:1")[0]["kv_transfer_params"] == PARAMS
    assert system.state.stats.retries["decode"] == 1


async def test_a_decode_that_may_have_pulled_makes_the_retry_prefill_again() -> None:
    broken = failing(UpstreamUnavailable("decode", "http://d0:1", "connection closed"))
    system = System([prefill_ok], [broken, decode_text(" ok")])
    answer = await system.ask(COMPLETION)
    assert answer.status == 200
    assert len(system.calls("http://p0:1")) == 2
    assert system.state.ledger.abandoned["decode_failed"] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_failing_everywhere_is_a_502_naming_prefill_without_the_fallback(stream: bool) -> None:
    down = failing(UpstreamConnectError("prefill", "http://p0:1", "cannot connect"))
    system = System(
        [down], [decode_text(" never")], retries=Retries(first_backoff_s=0, fallback_to_local_prefill=False)
    )
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 502
    assert "prefill instance http://p0:1" in orjson.loads(answer.body)["error"]["message"]
    assert system.calls("http://d0:1") == []


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_failing_everywhere_leaves_the_prompt_to_decode_by_default(stream: bool) -> None:
    down = failing(UpstreamConnectError("prefill", "http://p0:1", "cannot connect"))
    system = System([down], [decode_text(" computed here")])
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 200 and b" computed here" in answer.body
    [sent] = system.calls("http://d0:1")
    assert "kv_transfer_params" not in sent  # decode computes the prompt: no handoff to pull


@pytest.mark.parametrize("stream", [False, True])
async def test_no_decode_in_service_is_served_whole_by_a_prefill(stream: bool) -> None:
    """Survivors take every role: the only decode is restarting, so the prefill instance serves the
    request whole (no params), rather than the client getting a 503."""
    system = System([decode_text(" from prefill")], [decode_text(" never")])
    system.state.on_event(InstanceEvent("http://d0:1", "restarting", "exited with code 1"))
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 200 and b" from prefill" in answer.body
    [sent] = system.calls("http://p0:1")
    assert sent["max_tokens"] == COMPLETION["max_tokens"] and "kv_transfer_params" not in sent
    assert system.calls("http://d0:1") == [] and system.state.stats.num_stand_ins == 1


async def test_no_instance_of_either_role_in_service_is_a_503_naming_both() -> None:
    system = System([decode_text(" never")], [decode_text(" never")])
    for url in ("http://p0:1", "http://d0:1"):
        system.state.on_event(InstanceEvent(url, "restarting", "exited with code 1"))
    answer = await system.ask(COMPLETION)
    assert answer.status == 503
    message = orjson.loads(answer.body)["error"]["message"]
    assert "decode" in message and "no prefill instance can serve it whole" in message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_kept_alive_connection_decode_had_closed_is_retried_there_unseen_with_fresh_kv(
    stream: bool,
) -> None:
    stale = UpstreamStaleConnection("decode", "http://d0:1", "connection closed before the answer")
    answers = iter([failing(stale), decode_text(" fine")])
    system = System([prefill_ok], [lambda body: next(answers)(body)])
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 200 and b" fine" in answer.body
    # The only decode, asked again; its first request may have pulled the KV, so the second has its own.
    assert len(system.calls("http://d0:1")) == 2 and len(system.calls("http://p0:1")) == 2
    assert system.state.stats.retries["decode_stale"] == 1
    d0 = system.state.find("http://d0:1")
    assert d0 is not None and d0.breaker.num_consecutive_failures == 0


def stale_once(url: str, text: str) -> Script:
    """A decode whose first request is lost to a kept-alive connection it had closed."""
    answers = iter([failing(UpstreamStaleConnection("decode", url, "connection closed before the answer"))])

    def answer(body: dict[str, Any]) -> Answer:
        return next(answers, decode_text(text))(body)

    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_request_lost_to_a_closed_kept_alive_connection_stays_on_the_decode_chosen_for_it(
    stream: bool,
) -> None:
    # Two decodes under round robin: the chooser's next pick would be the other one.
    texts = {"http://d0:1": " from d0", "http://d1:1": " from d1"}
    system = System([prefill_ok], [stale_once(url, text) for url, text in texts.items()])
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 200
    [chosen] = [url for url in texts if system.calls(url)]  # the other decode was never asked
    assert len(system.calls(chosen)) == 2 and texts[chosen].encode() in answer.body
    assert len(system.calls("http://p0:1")) == 2  # the second time under a fresh prefill
    assert system.state.stats.retries == {"decode_stale": 1}


async def test_a_stream_whose_first_event_is_an_error_is_retried_unseen_by_the_client() -> None:
    error = sse.event(b'{"error": {"message": "KV load failed"}}')

    def pull_failed(body: dict[str, Any]) -> Answer:
        return Answer(chunks=[error, sse.DONE], content_type="text/event-stream")

    system = System([prefill_ok], [pull_failed, decode_text(" fine")])
    answer = await system.ask({**COMPLETION, "stream": True})
    assert answer.status == 200
    assert b"error" not in answer.body and b" fine" in answer.body
    assert answer.body.endswith(sse.DONE)


async def test_a_colocated_proxy_serves_every_request_whole_on_one_instance() -> None:
    system = System([], [decode_text(" whole")], colocated=True)
    answer = await system.ask(COMPLETION)
    assert answer.status == 200
    assert system.calls("http://d0:1") == [COMPLETION]
    assert system.state.can_serve()


async def test_an_instance_ray_restarted_on_another_node_is_served_at_its_new_address() -> None:
    system = System([prefill_ok], [decode_text(" old node")])
    system.scripts["http://d9:1"] = decode_text(" new node")
    state = system.state
    state.on_event(InstanceEvent("http://d0:1", "exited", "its Ray actor is restarting"))
    state.on_event(InstanceEvent("http://d0:1", "moved", "restarted on node 10.0.0.9", new_url="http://d9:1"))
    for _ in range(100):  # the old instance leaves once idle, on the proxy's loop
        if [i.url for i in state.pool("decode").instances] == ["http://d9:1"]:
            break
        await asyncio.sleep(0.01)
    assert [i.url for i in state.pool("decode").instances] == ["http://d9:1"]
    answer = await system.ask(COMPLETION)
    assert answer.status == 200 and b" new node" in answer.body


def failing_when_split(status: int, text: str) -> Script:
    """A decode whose KV pull fails (vLLM's 500 with ``kv_load_failure_policy=fail``) but which computes
    a prompt it is given whole."""

    def answer(body: dict[str, Any]) -> Answer:
        if "kv_transfer_params" in body:
            return Answer(status=status, body=b'{"error":{"message":"Internal server error","code":500}}')
        return decode_text(text)(body)

    return answer


@pytest.mark.parametrize("stream", [False, True])
async def test_the_only_decode_failing_its_pull_computes_the_prompt_itself_once(stream: bool) -> None:
    """Prefill died while decode pulled its KV: decode answers 500 and no prefill can stand in, so the
    client gets decode's own answer to the whole request instead of the 500."""
    no_stand_in = Retries(first_backoff_s=0, prefill_stands_in=False)  # as if prefill were gone
    system = System([prefill_ok], [failing_when_split(500, " computed here")], retries=no_stand_in)
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 200 and b" computed here" in answer.body
    split, whole = system.calls("http://d0:1")
    assert "kv_transfer_params" in split and "kv_transfer_params" not in whole
    # A failed pull may leave blocks in decode's cache under the prompt's hashes: the redo matches none.
    assert whole["cache_salt"].startswith("pdserve-redo-")
    assert system.state.stats.retries["decode"] == 1


def streaming_a_failed_pull(text: str) -> Script:
    """A decode whose KV pull fails as vLLM streams that (200, an error event first, [DONE]) but which
    computes a prompt it is given whole."""

    def answer(body: dict[str, Any]) -> Answer:
        if "kv_transfer_params" in body:
            error = sse.event(
                b'{"error": {"message": "Internal server error", "type": "InternalServerError"}}'
            )
            return Answer(chunks=[error, sse.DONE], content_type="text/event-stream")
        return decode_text(text)(body)

    return answer


async def test_the_only_decode_streaming_its_failed_pull_computes_the_prompt_itself() -> None:
    """A streamed request whose pull failed reaches the client as decode's answer to the whole prompt,
    not as vLLM's error event, although this decode is the only one."""
    system = System([prefill_ok], [streaming_a_failed_pull(" computed here")])
    answer = await system.ask({**COMPLETION, "stream": True})
    assert answer.status == 200 and b" computed here" in answer.body and b'"error"' not in answer.body
    split, whole = system.calls("http://d0:1")
    assert "kv_transfer_params" in split and whole["cache_salt"].startswith("pdserve-redo-")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_whose_pull_failed_computes_the_prompt_before_a_prefill_is_asked_to_stand_in(
    stream: bool,
) -> None:
    """The pull most often fails because the prefill holding the KV died: decode, which answered, serves
    the prompt itself, and that prefill is not handed the whole request (it would fail it too)."""
    failing = (
        failing_when_split(500, " computed here") if not stream else streaming_a_failed_pull(" computed here")
    )
    system = System([prefill_ok], [failing], retries=Retries(first_backoff_s=0))
    answer = await system.ask({**COMPLETION, "stream": stream})
    assert answer.status == 200 and b" computed here" in answer.body
    [to_prefill] = system.calls("http://p0:1")
    assert to_prefill["max_tokens"] == 1 and system.state.stats.num_stand_ins == 0


async def test_a_decode_failing_whole_too_is_the_clients_500_after_one_redo() -> None:
    broken = lambda body: Answer(status=500, body=b'{"error":{"message":"boom"}}')  # noqa: E731
    system = System([prefill_ok], [broken], retries=Retries(first_backoff_s=0, prefill_stands_in=False))
    answer = await system.ask(COMPLETION)
    assert answer.status == 500 and b"boom" in answer.body
    assert len(system.calls("http://d0:1")) == 2


async def test_a_decode_refusing_a_split_request_is_not_asked_again() -> None:
    system = System([prefill_ok], [failing_when_split(400, " never")])
    answer = await system.ask(COMPLETION)
    assert answer.status == 400
    assert len(system.calls("http://d0:1")) == 1
