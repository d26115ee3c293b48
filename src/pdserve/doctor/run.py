"""`pdserve doctor URL`: for every prefill→decode pair behind a pdserve proxy, does the handoff work,
and does it pay? (The checks are listed in README; the exit status in report.py.)

The order per pair: read both instances (HTTP), run the canary (canary.py), then find the instances'
logs (which need the canary's engine id to tell the live log from an older run's), compare the two
sides, and look for restarts. The proxy is only asked who is behind it; every call after that goes
straight to an instance, so the proxy's routing cannot pick a different pair than the one named.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from pdserve import httpclient
from pdserve.doctor import canary
from pdserve.doctor.advice import duration, judge, rate, size
from pdserve.doctor.facts import InstanceFacts, attach_log, compare, gather
from pdserve.doctor.logs import read_lanes, run_dirs
from pdserve.doctor.report import DoctorReport, PairReport, Status
from pdserve.doctor.report import brief as brief_lines
from pdserve.errors import Unreachable, VerifyError
from pdserve.patience import Waiting
from pdserve.prometheus import (
    BYTES_SUM,
    KV_EXPIRED,
    NOTIFS_AFTER_EXPIRY,
    XFER_COUNT,
    XFER_FAILED,
    XFER_TIME_SUM,
)

DEFAULT_PROMPT_TOKENS = 1500  # enough KV that the transfer is more than its fixed costs, within 2,048


def _get_json(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    try:
        response = httpclient.request(url, headers=headers, timeout=10)
    except Unreachable as exc:
        raise VerifyError(str(exc)) from exc
    return response.status, response.json()


def _short_id(engine_id: object) -> str:
    return f"{str(engine_id)[:8]}…"


def transport(p: InstanceFacts, d: InstanceFacts) -> str:
    """What is known of how decode's READs travel; 'unknown' parts said as such."""
    parts = []
    logs = [f.log for f in (p, d) if f.log]
    if not logs:
        return "unknown: no instance log found (pass --logs RUN_DIR, the directory `pdserve up` printed)"
    backends = sorted({b for log in logs for b in log.nixl_backends})
    parts.append(f"NIXL backend {', '.join(backends) if backends else 'unknown'}")
    devices = sorted({log.kv_buffer_device for log in logs if log.kv_buffer_device})
    if devices:
        parts.append(f"KV buffer on {'/'.join(devices)}")
    env = {k: v for log in logs for k, v in log.ucx_env.items() if k in ("UCX_TLS", "UCX_NET_DEVICES")}
    parts += [f"{k}={v}" for k, v in sorted(env.items())]
    lanes = read_lanes(d.log) if d.log else []
    if lanes:
        rows = sorted(
            {f"{lane.lane} ({lane.locality}, {lane.protocol}, sizes {lane.sizes})" for lane in lanes}
        )
        parts.append("UCX reads the KV over " + "; ".join(rows) + " (decode's log, UCX_PROTO_INFO)")
    else:
        parts.append(
            "UCX's lanes unknown (start the instances with UCX_PROTO_INFO=y and UCX prints them into the log)"
        )
    return "; ".join(parts)


# UCX transports that read another process's memory through the kernel, never a network device.
_SAME_KERNEL_TRANSPORTS: Final = frozenset({"cma", "knem", "xpmem", "sysv", "posix", "cuda_ipc"})


def same_kernel(pair: PairReport, p: InstanceFacts, d: InstanceFacts) -> None:
    """Prefill and decode at different addresses whose KV still never crossed a network: containers or
    namespaces on one machine share a kernel, UCX counts them as one node and reads by cross-memory
    attach (seen: netns "hosts" read over cma/memory). A test of the link between hosts proves nothing then."""
    hosts = {urlsplit(f.url).hostname or "" for f in (p, d)}
    if len(hosts) < 2 or not d.log:
        return
    lanes = sorted({lane.lane for lane in read_lanes(d.log)})
    bypass = [lane for lane in lanes if lane.split("/", 1)[0] in _SAME_KERNEL_TRANSPORTS]
    if bypass:
        pair.add(
            "warn",
            f"prefill and decode have different addresses ({', '.join(sorted(hosts))}) but UCX read the KV "
            f"over {', '.join(bypass)}, within one kernel: no KV byte crossed a network, so the numbers here "
            "say nothing of a link between hosts (UCX_TLS=tcp, or your fabric's transports, makes it cross)",
        )


def restarts(
    pair: PairReport,
    p: InstanceFacts,
    d: InstanceFacts,
    params: dict[str, Any] | None,
    recent: list[dict[str, Any]],
) -> None:
    """Restarts and stale engine ids: what the logs, decode's counters and the proxy's recent requests say."""
    current = params.get("remote_engine_id") if params else None
    # Prefill logs a late pull at its next step, so a canary's own may not be in the log yet: found, it
    # fails; not found proves nothing.
    if p.log and params and params.get("remote_request_id") in p.log.late_pulls:
        pair.check(
            False, "prefill's log: the canary's KV was pulled after prefill had released it (a late pull)"
        )
    if p.log and len(p.log.engine_ids) > 1:
        ids = " → ".join(_short_id(e) for e in p.log.engine_ids)
        pair.add("info", f"prefill restarted {len(p.log.engine_ids) - 1} time(s): engine ids {ids}")
    if d.log and len(d.log.engine_ids) > 1:
        pair.add("info", f"decode restarted {len(d.log.engine_ids) - 1} time(s)")
    if d.log and params:
        at = f"{params['remote_host']}:{params['remote_port']}"
        changes = [c for c in d.log.engine_changes if c[0] == at]
        for _, old, new in changes:
            pair.add("info", f"decode saw the engine at {at} replaced: {_short_id(old)} → {_short_id(new)}")
        if changes and changes[-1][2] != current:
            pair.add(
                "warn",
                f"decode last handshaked engine {_short_id(changes[-1][2])} at {at}, prefill now "
                f"answers as {_short_id(current)}",
            )
        if d.log.transfer_failures:
            kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(d.log.transfer_failures.items()))
            pair.add("warn", f"decode's log has NIXL transfer failures: {kinds}")
    # vLLM's counters since each instance started: (severity, the instance's samples, the counter, what it says)
    counted: tuple[tuple[Status, dict[str, float], str, str], ...] = (
        ("warn", d.metrics, XFER_FAILED, "decode counted {:g} failed transfer(s) since it started (stale "
         "params after a prefill restart fail like this: docs/vllm-kv-lifecycle.md §3)"),
        ("warn", p.metrics, NOTIFS_AFTER_EXPIRY, "prefill counted {:g} pull(s) of KV it had already released "
         "since it started: those answers may have been built from reused blocks"),
        ("info", p.metrics, KV_EXPIRED, "prefill let {:g} lease(s) expire unpulled since it started"),
    )  # fmt: skip
    for severity, metrics, name, says in counted:
        if metrics.get(name, 0.0):
            pair.add(severity, says.format(metrics[name]))
    stale = {
        str((t.get("kv_transfer_params") or {}).get("remote_engine_id"))
        for t in recent
        if t.get("prefill_url") == p.url and (t.get("kv_transfer_params") or {}).get("remote_engine_id")
    } - {str(current)}
    if current and stale:
        ids = ", ".join(_short_id(e) for e in sorted(stale))
        pair.add(
            "info",
            f"the proxy's recent requests used prefill engine id(s) {ids}; it now answers as "
            f"{_short_id(current)}: it restarted since",
        )


def lifetime(pair: PairReport, p: InstanceFacts, d: InstanceFacts) -> None:
    """The pair's transfers since it started, from the counters read before the canary: a second,
    larger sample of the same link. Decode counts the transfers it pulled, prefill those it pushed."""
    for facts, verb in ((d, "pulled"), (p, "pushed")):
        count, moved, seconds = (facts.metrics.get(n, 0.0) for n in (XFER_COUNT, BYTES_SUM, XFER_TIME_SUM))
        if count >= 1 and seconds > 0:
            pair.add(
                "info",
                f"when doctor started, {facts.role} had {verb} {count:g} KV transfer(s), {size(moved)} in "
                f"{duration(seconds)} ({rate(moved / seconds)}, {duration(seconds / count)} each)",
            )


def _recent_requests(proxy_url: str, admin_key: str | None) -> list[dict[str, Any]]:
    """The proxy's last requests (their params name the engine ids prefill had); [] if it will not say."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    try:
        status, body = _get_json(f"{proxy_url}/requests", headers)
    except VerifyError:
        return []
    return body.get("requests", []) if status == 200 and isinstance(body, dict) else []


def _pair(
    p: InstanceFacts,
    d: InstanceFacts,
    dirs: list[Path],
    recent: list[dict[str, Any]],
    prompt_tokens: int,
    waiting: Waiting | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> PairReport:
    pair = PairReport(p.url, d.url)
    for facts in (p, d):
        if facts.error:
            pair.check(False, f"{facts.role} {facts.url}: {facts.error}")
        elif facts.is_healthy is False:
            pair.add("warn", f"the proxy has {facts.role} {facts.url} as {facts.state}, not healthy")
    if pair.failures:
        return pair
    if d.model is None:
        pair.check(False, f"decode {d.url} names no model on /v1/models")
        return pair
    lifetime(pair, p, d)
    begun = time.time()
    measured = PairReport(p.url, d.url)
    params = canary.run(measured, p, d, d.model, prompt_tokens, waiting=waiting, say=say)
    attach_log(p, dirs, begun, params.get("remote_engine_id") if params else None)
    attach_log(d, dirs, begun, None)
    for facts in (p, d):
        if facts.log is not None:
            pair.add("info", f"{facts.role} log: {facts.log.path}")
        elif facts.log_note:
            pair.add("info", f"{facts.role} log: {facts.log_note}")
    compare(pair, p, d)
    pair.checks += measured.checks
    pair.handoff, pair.params = measured.handoff, measured.params
    restarts(pair, p, d, params, recent)
    pair.transport = transport(p, d)
    same_kernel(pair, p, d)
    pair.verdict = judge(pair.handoff) if pair.handoff else None
    return pair


def diagnose(
    proxy_url: str,
    log_dirs: Sequence[str] = (),
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    admin_key: str | None = None,
    say: Callable[[str], None] = lambda _m: None,
    waiting: Waiting | None = None,
) -> DoctorReport:
    """Every pair's checks, canary and verdict. VerifyError when the proxy cannot be asked at all.
    ``waiting``: how long each canary request waits on a busy pair (pdserve.patience)."""
    proxy_url = proxy_url.rstrip("/")
    report = DoctorReport(proxy_url)
    status, listing = _get_json(f"{proxy_url}/instances")
    if status != 200 or not isinstance(listing, list):
        raise VerifyError(f"{proxy_url}/instances answered {status}: is this a pdserve proxy?")
    facts = {i["url"]: gather(i["role"], i["url"], i) for i in listing}
    prefills = [f for f in facts.values() if f.role == "prefill"]
    decodes = [f for f in facts.values() if f.role == "decode"]
    elastic = [f for f in facts.values() if f.role == "elastic"]
    if elastic:
        # Instances of any role: a ring (each prefills for the next), so every instance is checked on
        # both sides with N canaries rather than N·(N-1).
        report.check(
            len(elastic) >= 2, f"the proxy lists {len(elastic)} elastic instance(s); a split needs two"
        )
        ring = list(zip(elastic, [*elastic[1:], *elastic[:1]], strict=True)) if len(elastic) >= 2 else []
    else:
        report.check(bool(prefills), f"the proxy lists {len(prefills)} prefill instance(s)")
        report.check(bool(decodes), f"the proxy lists {len(decodes)} decode instance(s)")
        ring = [(p, d) for p in prefills for d in decodes]
    # The canary asks each instance for the model it serves; the proxy's own answer (which an
    # --api-key may guard) only names it in the report.
    status, models = _get_json(f"{proxy_url}/v1/models")
    if status == 200 and isinstance(models, dict) and models.get("data"):
        report.model = models["data"][0]["id"]
    dirs = run_dirs(log_dirs)
    recent = _recent_requests(proxy_url, admin_key)
    for p, d in ring:
        say(f"pair {p.url} → {d.url} ...")
        report.pairs.append(_pair(p, d, dirs, recent, prompt_tokens, waiting, say))
    return report


def brief(proxy_url: str, log_dirs: Sequence[str] = ()) -> list[str]:
    """The short form for the end of `pdserve up` (e.g. ``brief(stack.proxy_url, [str(stack.run_dir)])``):
    one line per pair, and where to look on failure. A proxy that cannot be asked is one line too,
    never an exception: `up` should say so and carry on."""
    try:
        return brief_lines(diagnose(proxy_url, log_dirs))
    except VerifyError as exc:
        return [f"doctor: could not run: {exc}"]
