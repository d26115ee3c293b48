"""The push hand-over's sequence and its failures, against in-memory instances (handover.py, legs.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from memory_upstream import Answer, MemoryUpstream, Recorder, Script

from pdserve import sse
from pdserve.config import ProxyConfig, Role, Timeouts
from pdserve.configparts import Retries
from pdserve.errors import UpstreamConnectError
from pdserve.events import KVLogEvent
from pdserve.proxy.pool.policies import make_policy
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.record.responder import Responder
from pdserve.proxy.request.flow import Flow

PUSH_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e0",
               "remote_request_id": "cmpl-r-0-00000000", "remote_host": "10.0.0.1", "remote_port": 5600,
               "tp_size": 1, "pp_size": 1, "transfer_mode": "push"}  # fmt: skip
BODY: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 5, "temperature": 0}


def prefill(delay_s: float = 0.0, text: str = "He") -> Script:
    answer = {"id": "cmpl-r", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "kv_transfer_params": PUSH_PARAMS}  # fmt: skip
    # a stream: the instance stands in for a decode, serving the request whole
    return lambda body: (
        decode()(body) if body.get("stream") else Answer(body=orjson.dumps(answer), delay_s=delay_s)
    )


def decode(text: str = "Hello", delay_s: float = 0.0) -> Script:
    def answer(body: dict[str, Any]) -> Answer:
        if body.get("stream"):
            chunks = [
                sse.event(orjson.dumps({"choices": [{"index": 0, "text": t}]})) for t in (text[:2], text[2:])
            ]
            return Answer(chunks=[*chunks, sse.DONE], content_type="text/event-stream", delay_s=delay_s)
        return Answer(
            body=orjson.dumps({"choices": [{"text": text}], "kv_transfer_params": None}), delay_s=delay_s
        )

    return answer


class System:
    def __init__(self, prefills: list[Script], decodes: list[Script], **config: Any) -> None:
        urls: dict[Role, list[str]] = {"prefill": [f"http://p{i}:1" for i in range(len(prefills))],
                                       "decode": [f"http://d{i}:1" for i in range(len(decodes))]}  # fmt: skip
        scripts = dict(zip(urls["prefill"] + urls["decode"], prefills + decodes, strict=True))
        self.upstreams: dict[str, MemoryUpstream] = {}
        self.order: list[str] = []  # which instance got each request, in the order they were sent

        def make(role: Role, url: str) -> MemoryUpstream:
            def script(body: dict[str, Any]) -> Answer:
                self.order.append(url)
                return scripts[url](body)

            self.upstreams[url] = MemoryUpstream(role, url, script)
            return self.upstreams[url]

        settings = {"timeouts": Timeouts(), "retries": Retries(first_backoff_s=0), **config}
        cfg = ProxyConfig.pd(urls["prefill"], urls["decode"], **settings)
        policies = {"prefill": make_policy("round_robin"), "decode": make_policy("round_robin")}
        self.state = ProxyState(cfg, policies, make)  # type: ignore[arg-type]
        self.flow = Flow(self.state, cfg)

    async def ask(self, body: dict[str, Any]) -> Recorder:
        send = Recorder()
        await self.flow.serve("completions", orjson.dumps(body), None, Responder(send, "r"))
        return send

    def bodies(self, url: str) -> list[dict[str, Any]]:
        return [c.body for c in self.upstreams[url].calls]


def _text(send: Recorder) -> str:
    parts = []
    for p in sse.payloads(send.body):
        if p != sse.DONE_PAYLOAD and b'"error"' not in p:
            parts.extend(c.get("text") or "" for c in orjson.loads(p)["choices"])
    return "".join(parts)


async def test_once_prefill_is_known_to_take_pushes_decode_gets_its_request_first() -> None:
    system = System([prefill(delay_s=0.05)], [decode()])
    await system.ask(BODY)  # serial: the answer tells the proxy prefill's identity
    system.order.clear()
    send = await system.ask(BODY)
    assert send.status == 200
    assert system.order == ["http://d0:1", "http://p0:1"]
    early = system.bodies("http://d0:1")[-1]["kv_transfer_params"]
    # decode registers its blocks with that engine; what prefill has not computed yet is not asked for
    assert early["do_remote_prefill"] is True and early["remote_engine_id"] == "e0"
    assert (early["remote_host"], early["remote_port"], early["tp_size"]) == ("10.0.0.1", 5600, 1)
    assert early["remote_block_ids"] is None
    # both legs under one X-Request-Id: vLLM matches decode's registration to prefill's request by it
    assert system.upstreams["http://d0:1"].calls[-1].headers["X-Request-Id"] == system.upstreams[
        "http://p0:1"].calls[-1].headers["X-Request-Id"]  # fmt: skip
    assert system.state.traces[-1].handover == "push concurrent"


async def test_decodes_early_leg_counts_in_flight_there_from_the_start_and_once() -> None:
    system = System([prefill(delay_s=0.3)], [decode(delay_s=0.7)])
    system.flow._handover._identities["http://p0:1"] = {k: PUSH_PARAMS[k] for k in ("remote_engine_id",
                                                         "remote_host", "remote_port", "tp_size")}  # fmt: skip
    [d0] = [i for i in system.state.instances if i.url == "http://d0:1"]
    task = asyncio.create_task(system.ask({**BODY, "stream": True}))
    await asyncio.sleep(0.15)
    # while prefill computes, decode holds the request (push: its blocks, registered): a supervisor
    # asking whether that decode awaits a push must hear yes
    assert d0.num_in_flight == 1
    # but it owes no step yet: a slow prefill must not make its decode look stalled to routing and
    # back-pressure
    assert d0.lag_s(time.monotonic()) == 0.0 and d0.silence_s(time.monotonic()) == 0.0
    await asyncio.sleep(0.3)
    assert d0.num_in_flight == 1  # the decode attempt took the leg over: still one request
    assert (await task).status == 200
    assert d0.num_in_flight == 0


async def test_a_pull_prefill_keeps_the_legs_serial() -> None:
    pull = {**PUSH_PARAMS, "transfer_mode": "pull"}
    answer = orjson.dumps({"choices": [{"text": "x"}], "kv_transfer_params": pull})
    system = System([lambda body: Answer(body=answer)], [decode()])
    for _ in range(2):
        await system.ask(BODY)
    assert system.order == ["http://p0:1", "http://d0:1"] * 2
    assert system.bodies("http://d0:1")[-1]["kv_transfer_params"]["remote_block_ids"] == [[1]]


async def test_a_client_that_leaves_closes_decodes_leg_and_lets_prefill_finish_its_write() -> None:
    system = System([prefill(delay_s=0.3)], [decode(delay_s=5)])
    system.flow._handover._identities["http://p0:1"] = {k: PUSH_PARAMS[k] for k in ("remote_engine_id",
                                                         "remote_host", "remote_port", "tp_size")}  # fmt: skip
    finished: list[str] = []
    upstream = system.upstreams["http://p0:1"]
    post = upstream.post

    async def recording_post(*args: Any, **kwargs: Any) -> Any:
        reply = await post(*args, **kwargs)
        finished.append("prefill")
        return reply

    upstream.post = recording_post  # type: ignore[method-assign]
    task = asyncio.create_task(system.ask({**BODY, "stream": True}))
    await asyncio.sleep(0.1)
    task.cancel()  # what the proxy does when the client hangs up
    await asyncio.gather(task, return_exceptions=True)
    assert finished == []
    await asyncio.sleep(0.4)
    # decode's blocks are freed by prefill's WRITE only (vLLM 0.32): its leg ran to the end
    assert finished == ["prefill"]
    assert not system.flow._handover._background
    assert all(i.num_in_flight == 0 for i in system.state.instances)  # decode's leg closed


async def test_a_push_that_never_arrives_ends_within_the_lease_and_the_prompt_is_computed_again() -> None:
    slow_then_fine = iter([decode(delay_s=30), decode()])
    system = System([prefill()], [lambda body: next(slow_then_fine)(body)], kv_lease_s=1)
    system.flow._handover._identities["http://p0:1"] = {"remote_engine_id": "e0", "remote_host": "10.0.0.1",
                                                        "remote_port": 5600, "tp_size": 1}  # fmt: skip
    began = time.monotonic()
    send = await system.ask({**BODY, "stream": True})
    assert time.monotonic() - began < 5
    assert send.status == 200 and _text(send) == "Hello"
    # no handoff left to trust: the prompt was computed again, by whoever served it
    last = system.order[-1]
    assert "kv_transfer_params" not in system.bodies(last)[-1]


async def test_prefill_dead_after_decode_registered_lets_decode_compute_the_prompt_anew() -> None:
    def dead(body: dict[str, Any]) -> Answer:
        raise UpstreamConnectError("prefill", "http://p0:1", "connection refused")

    # the early leg stands for a registration no WRITE will fulfil: it never answers
    waits_for_a_write = iter([decode(delay_s=30), decode()])
    system = System([dead], [lambda body: next(waits_for_a_write)(body)], kv_lease_s=20)
    system.flow._handover._identities["http://p0:1"] = {"remote_engine_id": "e0", "remote_host": "10.0.0.1",
                                                        "remote_port": 5600, "tp_size": 1}  # fmt: skip
    began = time.monotonic()
    send = await system.ask(BODY)
    assert time.monotonic() - began < 5, "the request waited on a push from a dead prefill"
    assert send.status == 200 and b"Hello" in send.body
    # decode's second request computes the prompt: no params that would have it wait for a push
    assert [("kv_transfer_params" in b) for b in system.bodies("http://d0:1")] == [True, False]
    assert all(i.num_in_flight == 0 for i in system.state.instances)  # the early leg, closed, counts out


async def test_decode_dead_before_its_registration_hands_the_unread_kv_to_another_decode() -> None:
    def dead(body: dict[str, Any]) -> Answer:
        raise UpstreamConnectError("decode", "http://d0:1", "connection refused")

    system = System(
        [prefill()], [dead, decode()], retries=Retries(first_backoff_s=0)
    )  # 2 decode attempts: the default
    system.flow._handover._identities["http://p0:1"] = {"remote_engine_id": "e0", "remote_host": "10.0.0.1",
                                                        "remote_port": 5600, "tp_size": 1}  # fmt: skip
    send = await system.ask(BODY)
    assert send.status == 200 and b"Hello" in send.body
    # prefill's blocks were never registered by the dead decode: the other one registers for them
    params = system.bodies("http://d1:1")[-1]["kv_transfer_params"]
    assert params["remote_engine_id"] == "e0" and params["remote_request_id"] == "cmpl-r-0-00000000"


async def test_the_first_token_goes_to_the_client_before_decode_answers() -> None:
    system = System([prefill(text="He")], [decode(text="Hello")], first_token_at_once=True)
    send = await system.ask({**BODY, "stream": True})
    texts = [orjson.loads(p)["choices"][0]["text"] for p in sse.payloads(send.body) if p != sse.DONE_PAYLOAD]
    assert texts[0] == "He" and "".join(texts) == "Hello"
    assert system.state.traces[-1].handover == "push + first token at once"


PULL_PARAMS = {k: v for k, v in PUSH_PARAMS.items() if k != "transfer_mode"}


def _prefill_ids(body: dict[str, Any], request_id: str = PULL_PARAMS["remote_request_id"]) -> Answer:
    """Prefill samples "He" (id 9) for the prompt [1, 2, 3]."""
    choice: dict[str, Any] = {"index": 0, "text": "He", "finish_reason": "length"}
    if body.get("return_token_ids"):
        prompt = body["prompt"] if isinstance(body["prompt"], list) else [1, 2, 3]
        choice |= {"prompt_token_ids": prompt, "token_ids": [9]}
    params = {**PULL_PARAMS, "remote_request_id": request_id}
    answer = {"id": "cmpl-r", "created": 1, "model": "m", "choices": [choice], "kv_transfer_params": params}
    return Answer(body=orjson.dumps(answer))


def _decode_ids(first: str, first_id: int) -> Script:
    """Decode's stream: ``first`` (``first_id``) then "!"; a continuation from [1, 2, 3, 9]: "llo you"."""

    def answer(body: dict[str, Any]) -> Answer:
        def event(text: str, ids: list[int], **extra: Any) -> bytes:
            choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": None, **extra}
            return sse.event(orjson.dumps({"id": "cmpl-r", "created": 1, "model": "m", "choices": [choice]}))

        if isinstance(body["prompt"], list):  # the continuation: the prompt and prefill's token, as ids
            chunks = [event("llo", [10], prompt_token_ids=body["prompt"]), event(" you", [11])]
        else:
            chunks = [event(first, [first_id], prompt_token_ids=[1, 2, 3]), event("!", [12])]
        return Answer(chunks=[*chunks, sse.DONE], content_type="text/event-stream")

    return answer


async def test_a_decode_that_draws_another_first_token_goes_on_from_the_one_the_client_has() -> None:
    # bf16 logits of two instances differ: prefill sampled "He" (id 9), decode draws "Yo" (id 8)
    system = System([_prefill_ids], [_decode_ids("Yo", 8)], first_token_at_once=True)
    send = await system.ask({**BODY, "stream": True})
    assert b'"error"' not in send.body
    assert _text(send) == "Hello you"  # never "He" followed by what decode wrote after its "Yo"
    assert b"token_ids" not in send.body.replace(b'"token_ids":null', b"").replace(
        b'"prompt_token_ids":null', b""
    )
    continuation = system.bodies("http://d0:1")[-1]
    assert continuation["prompt"] == [1, 2, 3, 9] and continuation["max_tokens"] == BODY["max_tokens"] - 1
    [migration] = system.state.traces[-1].migrations
    assert migration["result"] == "ok"
    assert system.state.find("http://d0:1").is_available(time.monotonic())  # nothing wrong with decode


async def test_an_answer_the_lease_guard_withholds_after_the_first_token_goes_on_from_that_token() -> None:
    ids = iter(range(100))  # vLLM names every prefill anew
    system = System(
        [lambda body: _prefill_ids(body, f"cmpl-r-0-{next(ids):08x}")],
        [_decode_ids("He", 9)],
        first_token_at_once=True,
    )
    pulling = _decode_ids("He", 9)

    def decode_after_release(body: dict[str, Any]) -> Answer:
        if len(system.bodies("http://d0:1")) == 1:  # prefill's log said it released the KV mid-pull
            system.state.on_event(KVLogEvent("http://p0:1", "expired", "cmpl-r-0-00000000", at=0.0))
        return pulling(body)

    system.upstreams["http://d0:1"].script = decode_after_release
    send = await system.ask({**BODY, "stream": True})
    assert b'"error"' not in send.body
    assert _text(send) == "Hello you"  # decode's suspect "He!" never reached the client
    assert system.bodies("http://d0:1")[-1]["prompt"] == [1, 2, 3, 9]
    assert system.state.ledger.suspects["log"] == 1


async def test_a_decode_left_with_pushes_that_never_came_rests_while_another_decode_serves() -> None:
    prefill_is_up = False

    def flaky(body: dict[str, Any]) -> Answer:
        if not prefill_is_up:
            raise UpstreamConnectError("prefill", "http://p0:1", "connection refused")
        return prefill()(body)

    def waits_for_writes(body: dict[str, Any]) -> Answer:
        # an early leg waits for a WRITE that never comes; a request of its own is served
        params = body.get("kv_transfer_params") or {}
        return decode(delay_s=30)(body) if params.get("remote_block_ids", 0) is None else decode()(body)

    system = System([flaky], [waits_for_writes, decode()], kv_lease_s=20)
    d0, d1 = system.state.pool("decode").instances
    for _ in range(3):
        system.state.check_failed(d1, "down")  # out of service while prefill fails
    identity = {"remote_engine_id": "e0", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}
    for _ in range(4):
        system.flow._handover._identities["http://p0:1"] = dict(identity)  # as a prefill that came back
        send = await system.ask(BODY)
        assert send.status == 200 and b"Hello" in send.body  # d0 computed the prompt itself
    assert d0.num_stranded == 4 and system.state.describe_instance(d0)["state"] == "resting"
    # resting, but the only decode: it still serves
    assert (await system.ask(BODY)).status == 200
    system.state.check_passed(d1, None)
    prefill_is_up = True
    sent_to_d0 = len(system.bodies("http://d0:1"))
    for _ in range(4):
        system.flow._handover._identities["http://p0:1"] = dict(identity)
        send = await system.ask({**BODY, "stream": True})
        assert send.status == 200 and _text(send) == "Hello"
    assert len(system.bodies("http://d0:1")) == sent_to_d0, "a resting decode got requests beside d1"
    # its supervisor restarted it: its blocks are gone, it serves again
    d0.restarting("exited: restarted to free KV blocks registered for a push that never came")
    d0.restarted()
    assert system.state.describe_instance(d0)["state"] == "serving"
