"""Soak: mixed traffic through `pdserve up`'s Stack on real vLLM while faults are injected on a schedule.

    flock /tmp/pdserve-vllm.lock .venv/bin/python benchmarks/soak.py [--duration 600] [--kv-lease 8] [--elastic 2]
        [--begin-at-fault 3] [--model default --busy 3 --no-faults --concurrency 8]

1P1D on the embedded tiny model (`Topology(kv_lease_s=8)`, supervised: exited instances are restarted), or
with ``--elastic N`` an elastic pool of N instances that each take any role (the proxy decides per request).
Workers send completions and chat, streamed or not, short to long prompts, 4 to 32 tokens out, greedy;
some streamed clients hang up after their first chunks. Every prompt carries a fresh ``cache_salt``, so
no request finds another's blocks in a prefix cache and every one moves its KV, while the greedy answer
stays that of its template, fetched once, before any fault, from the prefill instance alone. Requests
go through pdserve's load generator (bench/load.py ``send``), which keeps each answer's text to judge.

Injected in turn, with a quiet gap after each one's recovery: SIGSTOP of decode's EngineCore for
lease + 6 s, the same for prefill, SIGKILL of prefill's process group, the same for decode (the
supervisor restarts them; the next fault waits until the proxy has every instance in service again); in an elastic pool the same four on its
last instance, its first, its first and its last. Reported (JSON on stdout and in --out):
requests by outcome, errors by kind, wrong answers (must be 0), hung requests (no end within the client's
deadline; must be 0), suspect handoffs the proxy caught and streams it migrated (/metrics), the ledger's
open handoffs and the instances' KV usage at the end, and vLLM's lease counters.

Overload instead of faults: ``--busy N`` runs N busy processes beside the engines for the whole run (the
cores saturated), ``--no-faults`` injects nothing, ``--model default`` serves SmolLM2 instead of the tiny
model. Then what matters is printed first: client errors, wrong answers, answers the proxy relayed from KV
whose lease had run out (prefill's log said so after delivery: must be 0), the leases lost per minute
(prefill's ``vllm:nixl_num_kv_expired_reqs_total``), and the time requests waited at the proxy for room
at decode (``pdserve_decode_wait_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdserve import prometheus
from pdserve.bench.load import Job, send, text_of
from pdserve.config import ProxySettings, Timeouts
from pdserve.configparts import ApiKeys
from pdserve.engines.placement import InstanceSpec
from pdserve.errors import MetricsUnreadable
from pdserve.stack import Stack
from pdserve.topology import RoleSpec, Topology

ADMIN_KEY = "soak-admin"
WORDS = [
    "ferry", "grey", "water", "harbour", "lantern", "copper", "north", "wind", "river", "stone", "orchard",
    "winter", "signal", "bridge", "market", "tide", "island", "gull", "rope", "anchor", "cedar", "meadow",
]  # fmt: skip
VLLM_COUNTERS = {"kv_expired": prometheus.KV_EXPIRED, "notifications_after_expiry": prometheus.NOTIFS_AFTER_EXPIRY,
                 "transfers": prometheus.XFER_COUNT, "failed_transfers": prometheus.XFER_FAILED}  # fmt: skip
# (words in the prompt, tokens out): short prompts to ones of several 128-token blocks.
SHAPES = ((12, 8), (40, 16), (120, 24), (260, 32), (420, 16), (30, 4))


@dataclass(frozen=True)
class Template:
    name: str
    endpoint: str  # "completions" or "chat"
    prompt: str
    max_tokens: int
    ignore_eos: bool = False  # the answer is max_tokens long whatever the model says


# A stream still mid-answer LONG_STREAM_KILL_AFTER_S after it is sent (the tiny model streams a few
# hundred tokens a second here), so that the decode killed then holds it.
LONG_STREAM = Template(
    "long-stream", "completions", "a long answer: " + " ".join(WORDS), 1200, ignore_eos=True
)
LONG_STREAM_KILL_AFTER_S = 1.0


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)  # ok, error, disconnected, wrong, hung
    errors: Counter[str] = field(default_factory=Counter)  # by kind
    wrong: list[dict[str, Any]] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    # Requests the lease guard sent back to prefill: (template, prompt tokens, outcome)
    lease_retried: list[tuple[str, int, str]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def templates(seed: int) -> list[Template]:
    rng = random.Random(seed)
    out = []
    for i, (num_words, max_tokens) in enumerate(SHAPES * 2):
        text = " ".join(rng.choice(WORDS) for _ in range(num_words))
        for endpoint in ("completions", "chat"):
            out.append(Template(f"t{i}-{endpoint}", endpoint, f"story {i}: {text}", max_tokens))
    return out


def body(t: Template, model: str, stream: bool, salt: str | None) -> dict[str, Any]:
    b: dict[str, Any] = {"model": model, "max_tokens": t.max_tokens, "temperature": 0, "stream": stream}
    if t.endpoint == "completions":
        b["prompt"] = t.prompt
    else:
        b["messages"] = [{"role": "user", "content": t.prompt}]
    if salt is not None:
        b["cache_salt"] = salt
    if t.ignore_eos:
        b["ignore_eos"] = True
    return b


def path(t: Template) -> str:
    return "/v1/completions" if t.endpoint == "completions" else "/v1/chat/completions"


def kind_of(status: int, message: str) -> str:
    """An error's kind: its status and message with URLs, ids and numbers taken out."""
    message = re.sub(r"https?://\S+", "URL", message)
    message = re.sub(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?", "N", message)
    return f"{status} {message[:110]}"


async def ask(
    http: aiohttp.ClientSession, url: str, t: Template, model: str, stream: bool, hang_up: bool,
    deadline_s: float,
) -> tuple[str, str, str, float]:  # fmt: skip
    """(outcome, text, detail, retry_after_s): outcome ok | error | disconnected | hung; detail is the
    request id, or the error's kind."""
    request_id = f"soak-{uuid.uuid4().hex[:12]}"
    job = Job(path(t), body(t, model, stream, salt=uuid.uuid4().hex), {"X-Request-Id": request_id})
    sent = await send(http, url, job, deadline_s, hang_up_after=2 if hang_up else None)
    if sent.is_timed_out:
        return "hung", sent.text, request_id, 0.0
    if sent.is_hung_up:
        return "disconnected", sent.text, request_id, 0.0
    if sent.ok:
        return "ok", sent.text, request_id, 0.0
    return "error", sent.text, kind_of(sent.status, sent.error or ""), sent.retry_after_s


async def references(
    http: aiohttp.ClientSession, url: str, ts: list[Template], model: str
) -> dict[str, tuple[str, int]]:
    """Each template's greedy answer from one instance alone (no PD, no salt), and its prompt tokens."""
    out = {}
    for t in ts:
        async with http.post(url + path(t), json=body(t, model, False, None)) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            out[t.name] = text_of(data["choices"][0]), int(data["usage"]["prompt_tokens"])
    return out


async def lease_retries(http: aiohttp.ClientSession, proxy_url: str, request_id: str) -> int:
    """How often the proxy's lease guard sent this request back to prefill (its /requests trace)."""
    async with http.get(proxy_url + "/requests", params={"id": request_id},
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:  # fmt: skip
        traces = (await resp.json())["requests"]
    return sum("prefilling again" in r for t in traces for r in t["retries"])


@dataclass(frozen=True)
class Client:
    """What every request needs: the session, the proxy, the references and the running tally."""

    http: aiohttp.ClientSession
    proxy_url: str
    refs: dict[str, tuple[str, int]]  # template name -> (single-instance answer, prompt tokens)
    model: str
    tally: Tally
    deadline_s: float

    async def one(self, t: Template, stream: bool, hang_up: bool = False) -> str:
        """Send one request, judge it against its reference and count it; returns the outcome."""
        tally, begun = self.tally, time.monotonic()
        outcome, text, detail, retry_after = await ask(
            self.http, self.proxy_url, t, self.model, stream, hang_up, self.deadline_s
        )
        expected, num_prompt_tokens = self.refs[t.name]
        is_slow = outcome in ("ok", "disconnected") and time.monotonic() - begun > 2.0
        if is_slow and await lease_retries(self.http, self.proxy_url, detail):
            is_right = text == expected or (outcome == "disconnected" and expected.startswith(text))
            tally.lease_retried.append((t.name, num_prompt_tokens, "right" if is_right else "WRONG"))
        if outcome == "ok" and text != expected:
            outcome = "wrong"
        elif outcome in ("error", "disconnected") and not expected.startswith(text):
            outcome = "wrong"  # a partial answer must still be the start of the right one
        tally.outcomes[outcome] += 1
        if outcome == "ok":
            tally.latencies.append(time.monotonic() - begun)
        elif outcome == "error":
            tally.errors[detail] += 1
            await asyncio.sleep(max(0.5, retry_after))  # a client that got an error does not hammer
        elif outcome == "wrong":
            tally.wrong.append({"template": t.name, "stream": stream, "got": text, "expected": expected,
                                "detail": detail})  # fmt: skip
        elif outcome == "hung":
            tally.hung.append(detail)
        return outcome


async def worker(client: Client, ts: list[Template], stop_at: float, rng: random.Random) -> None:
    while time.monotonic() < stop_at:
        stream = rng.random() < 0.5
        await client.one(rng.choice(ts), stream, hang_up=stream and rng.random() < 0.12)


def schedule(stack: Stack, rotate: int = 0) -> list[tuple[str, InstanceSpec]]:
    """The faults in turn: (stall | kill, the instance), begun ``rotate`` turns in (on a small machine a
    10-minute run may see only the first three: a kill's restart takes minutes while the survivor serves)."""
    if stack.topology.is_elastic:
        first, last = stack.specs[0], stack.specs[-1]
        turns = [("stall", last), ("stall", first), ("kill", first), ("kill", last)]
    else:
        prefill, decode = (next(s for s in stack.specs if s.role == r) for r in ("prefill", "decode"))
        turns = [("stall", decode), ("stall", prefill), ("kill", prefill), ("kill", decode)]
    return turns[rotate:] + turns[:rotate]


async def stall(stack: Stack, spec: InstanceSpec, seconds: float) -> dict[str, Any]:
    core = stack.group.engine_core_pid(spec)
    if core is None:
        return {"fault": f"stall {spec.name}", "skipped": "no EngineCore found"}
    os.kill(core, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(core, signal.SIGCONT)
    return {"fault": f"stall {spec.name}", "seconds": seconds}


async def kill(stack: Stack, spec: InstanceSpec, limit_s: float) -> dict[str, Any]:
    since = time.monotonic()
    stack.group.kill(spec)
    while time.monotonic() - since < limit_s:
        await asyncio.sleep(1.0)
        back = [e for at, e in list(stack.instance_events) if at >= since and e.url == spec.url]
        if any(e.kind == "ready" for e in back):
            return {"fault": f"kill {spec.name}", "back_after_s": round(time.monotonic() - since, 1)}
        if any(e.kind == "gave_up" for e in back):
            return {"fault": f"kill {spec.name}", "gave_up": [e.detail for e in back]}
    return {"fault": f"kill {spec.name}", "not_back_within_s": limit_s}


async def faults(
    stack: Stack, client: Client, probes: list[Template], lease: float, start: float, stop_at: float,
    gap_s: float, rotate: int = 0,
) -> None:  # fmt: skip
    """The schedule. The first stall (decode's) also sends ``probes`` (long prompts, whole and
    streamed) as it begins, so requests of several KV blocks certainly meet it. Decode's kill in a 1P1D
    pool comes while a long stream (``LONG_STREAM``) is mid-answer there, which must migrate."""
    sent: list[asyncio.Task[str]] = []
    turns = schedule(stack, rotate)
    probed = schedule(stack)[0]  # decode's stall (an elastic pool's last instance's)
    i = 0
    await asyncio.sleep(gap_s)
    while True:
        action, spec = turns[i % len(turns)]
        # A kill costs a restart (~1 min on a 2-core machine): only when there is time to see it back.
        need = lease + 6 + gap_s if action == "stall" else 100.0
        if time.monotonic() + need > stop_at:
            await asyncio.gather(*sent)
            return
        if not await all_serving(client, stop_at - need):
            await asyncio.gather(*sent)
            return
        begun = time.monotonic()
        if action == "stall":
            stalling = asyncio.create_task(stall(stack, spec, lease + 6))
            if (action, spec) == probed:
                await asyncio.sleep(0.5)
                sent += [asyncio.create_task(client.one(t, s)) for t in probes for s in (False, True)]
            record = await stalling
        else:
            if spec.role == "decode":  # an elastic pool's router decides where a stream decodes
                sent.append(asyncio.create_task(client.one(LONG_STREAM, True)))
                await asyncio.sleep(LONG_STREAM_KILL_AFTER_S)
            record = await kill(stack, spec, limit_s=300.0)
        record["at_s"] = round(begun - start, 1)
        client.tally.faults.append(record)
        print(f"[soak] {record}", flush=True)
        i += 1
        await asyncio.sleep(gap_s)


async def all_serving(client: Client, until: float) -> bool:
    """Wait until the proxy has every instance in service again (a restart on a loaded machine can
    outlast ``kill``'s limit): a fault is never injected while another one's instance is still down."""
    while time.monotonic() < until:
        async with client.http.get(client.proxy_url + "/instances") as resp:
            instances = await resp.json()
        if all(i["state"] == "serving" for i in instances):
            return True
        await asyncio.sleep(1.0)
    return False


async def scrape(url: str) -> dict[str, float]:
    """``url``'s /metrics, or none while it cannot be read (an instance restarting)."""
    try:
        return await asyncio.to_thread(prometheus.scrape, url)
    except MetricsUnreadable:
        return {}


def busy(num: int) -> list[subprocess.Popen[bytes]]:
    """``num`` processes that each keep a core busy, as other tenants of the machine would."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(num)
    ]


def overload_summary(report: dict[str, Any], proxy_m: dict[str, float]) -> dict[str, Any]:
    """The overload case's figures, first in the report."""
    minutes = report["duration_s"] / 60
    waits = proxy_m.get("pdserve_decode_wait_seconds_count", 0.0)
    waited_s = proxy_m.get("pdserve_decode_wait_seconds_sum", 0.0)
    return {
        "client_errors": report["outcomes"].get("error", 0), "wrong_answers": report["wrong_answers"],
        "hung": report["hung"],
        "lease_expired_kv_served": (report["suspect_by_reason"] or {}).get("log_after_delivery", 0),
        "leases_lost": report["kv_expired"], "leases_lost_per_min": round(report["kv_expired"] / minutes, 2),
        "lease_retries": report["lease_retries"],
        "ok_per_min": round(report["outcomes"].get("ok", 0) / minutes, 1),
        "proxy_waits": waits, "proxy_wait_s_total": round(waited_s, 1),
        "proxy_wait_s_mean": round(waited_s / waits, 2) if waits else 0.0,
        # decode's request until its first byte (the KV pull and its queue there): what the lease must cover
        "decode_first_byte_s_mean": round(proxy_m.get("pdserve_decode_first_byte_seconds_sum", 0.0)
                                          / max(1.0, proxy_m.get("pdserve_decode_first_byte_seconds_count", 0.0)), 2),
        "decode_first_byte_over_5s": report["decode_first_byte_over_5s"],
    }  # fmt: skip


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.out).with_suffix("") if args.out else None
    # A small pool makes prefill reuse released blocks at once, so a late pull reads another prompt's KV
    # (with vLLM's own pool of thousands of blocks it mostly reads intact leftovers).
    blocks = ("--num-gpu-blocks-override", str(args.prefill_blocks)) if args.prefill_blocks else ()
    roles: dict[str, Any] = (
        {"elastic": RoleSpec(count=args.elastic, args=blocks)}
        if args.elastic
        else {"prefill": RoleSpec(args=blocks)}
    )
    topology = Topology(
        model=None if args.model == "default" else args.model,
        proxy_port=22500, first_port=22510, first_side_channel_port=22600, kv_lease_s=args.kv_lease,
        on_instance_exit="restart", run_dir=str(run_dir) if run_dir else None, **roles,
    )  # fmt: skip
    settings = ProxySettings(
        timeouts=Timeouts(connect=5, prefill=60, first_token=90, idle=60, decode=120, request=150),
        api_keys=ApiKeys(admin=ADMIN_KEY),
    )
    with Stack(topology, say=lambda m: print(f"[soak] {m}", flush=True), proxy=settings) as stack:
        assert stack.model is not None
        model = stack.model.served_model_name or stack.model.path
        ts = templates(args.seed)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            # The long stream only meets decode's kill; on the default model its reference takes minutes.
            refs = await references(
                http, stack.specs[0].url, ts if args.no_faults else [*ts, LONG_STREAM], model
            )
            tally = Tally()
            start = time.monotonic()
            stop_at = start + args.duration
            rng = random.Random(args.seed)
            client = Client(http, stack.proxy_url, refs, model, tally, args.deadline)
            workers = [
                worker(client, ts, stop_at, random.Random(rng.random())) for _ in range(args.concurrency)
            ]
            probes = sorted(ts, key=lambda t: -refs[t.name][1])[:2]  # the two longest prompts
            hogs = busy(args.busy)
            try:
                injected = [] if args.no_faults else [
                    faults(stack, client, probes, args.kv_lease, start, stop_at, args.gap, args.begin_at_fault)]  # fmt: skip
                await asyncio.gather(*injected, *workers)
            finally:
                for hog in hogs:
                    os.killpg(hog.pid, signal.SIGKILL)
                    hog.wait(timeout=10)
            ran_s = time.monotonic() - start
            # Everything answered: every instance's KV should be back to idle within a lease.
            holders = [s.url for s in stack.specs if s.role != "decode"]
            idle_after, usage = None, {}
            for _ in range(int(args.kv_lease * 4) + 20):
                usage = {url: (await scrape(url)).get("vllm:kv_cache_usage_perc") for url in holders}
                async with http.get(stack.proxy_url + "/admin/ledger",
                                    headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:  # fmt: skip
                    ledger = await resp.json()
                if all(u == 0.0 for u in usage.values()) and not ledger["open"]:
                    idle_after = round(time.monotonic() - start - ran_s, 1)
                    break
                await asyncio.sleep(0.5)
            proxy_m = await scrape(stack.proxy_url)
            samples = prometheus.parse_samples(
                await asyncio.to_thread(prometheus.scrape_text, stack.proxy_url)
            )
            migrations = {
                m.labels.get("result", ""): m.value for m in samples if m.name == "pdserve_migrations_total"
            }
            first_byte = {m.labels.get("le"): m.value for m in samples
                          if m.name == "pdserve_decode_first_byte_seconds_bucket"}  # fmt: skip
            over_5s = first_byte.get("+Inf", 0.0) - first_byte.get("5.0", 0.0)
            lease_retries = sum(
                m.value
                for m in samples
                if m.name == "pdserve_retries_total" and m.labels.get("phase") == "lease"
            )
            after = [await scrape(s.url) for s in stack.specs]
    # vLLM's counters reset when an instance restarts: these are of each one's last incarnation only.
    counters = {key: sum(m.get(name, 0.0) for m in after) for key, name in VLLM_COUNTERS.items()}
    lat = sorted(tally.latencies)
    served = sum(tally.outcomes.values())
    report = {
        "pool": f"elastic {args.elastic}" if args.elastic else "1P1D",
        "duration_s": round(ran_s, 1), "kv_lease_s": args.kv_lease, "concurrency": args.concurrency,
        "prefill_blocks": args.prefill_blocks or "vLLM's own",
        "requests": served, "outcomes": dict(tally.outcomes), "errors_by_kind": dict(tally.errors.most_common()),
        "wrong_answers": len(tally.wrong), "wrong": tally.wrong[:10], "hung": len(tally.hung),
        "ok_latency_s": {"p50": lat[len(lat) // 2] if lat else None, "p99": lat[int(len(lat) * 0.99)] if lat else None},
        "suspect_handoffs": proxy_m.get("pdserve_kv_handoffs_suspect_total", 0.0),
        "suspect_by_reason": ledger.get("suspect"), "ledger_abandoned": ledger.get("abandoned"),
        "ledger_issued": ledger.get("issued"), "ledger_open_at_end": len(ledger["open"]),
        "kv_usage_at_end": usage, "idle_after_s": idle_after,
        "faults": tally.faults,
        "template_prompt_tokens": {name: n for name, (_, n) in refs.items()},
        "lease_retried": [{"template": a, "prompt_tokens": b, "answer": c} for a, b, c in tally.lease_retried],
        **counters,
        "proxy_retries": {k: v for k, v in proxy_m.items() if k.startswith("pdserve_retries")},
        "migrations": migrations, "lease_retries": lease_retries, "decode_first_byte_over_5s": over_5s,
        "run_dir": str(stack.run_dir),
        "busy_processes": args.busy,
    }  # fmt: skip
    return (
        {"overload": overload_summary(report, proxy_m), **report} if args.busy or args.no_faults else report
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    p.add_argument("--kv-lease", type=int, default=8, help="vLLM's kv_lease_duration, whole seconds >= 6")
    p.add_argument("--concurrency", type=int, default=3, help="clients sending at once (default 3)")
    p.add_argument("--deadline", type=float, default=200.0, help="a client's limit per request, seconds")
    p.add_argument("--gap", type=float, default=20.0, help="quiet seconds after each fault's recovery")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-blocks", type=int, default=0, help="prefill's KV pool in blocks (0: vLLM's)")
    p.add_argument("--begin-at-fault", type=int, default=0, choices=range(4),
                   help="start the schedule at this turn (3: decode's kill, with a stream mid-answer there)")  # fmt: skip
    p.add_argument("--elastic", type=int, default=0, help="an elastic pool of N instances instead of 1P1D")
    p.add_argument(
        "--model", default="tiny", help="tiny (default), default (SmolLM2, what `up` serves) or a dir"
    )
    p.add_argument("--busy", type=int, default=0, help="busy processes beside the engines for the whole run")
    p.add_argument("--no-faults", action="store_true", help="inject no fault: overload alone (with --busy)")
    p.add_argument("--out", help="write the JSON report here too (its stem names the run dir)")
    args = p.parse_args()
    report = asyncio.run(soak(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["wrong_answers"] == 0 and report["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
