"""What one vLLM instance says about itself over HTTP, what its log adds, and whether a prefill and a
decode agree on everything the KV handoff depends on.

vLLM 0.32 exposes: ``/v1/models`` (id, root, max_model_len), ``/version``, and on ``/metrics`` the
info gauge ``vllm:cache_config_info`` (block_size, cache_dtype, prefix caching, …; its
``kv_cache_layout`` label is the unresolved config, ``None``, since the NixlConnector picks the layout
later). The model's dtype and the resolved KV layout are only in the log. ``/server_info`` would have
all of it, but exists only with ``VLLM_SERVER_DEV_MODE=1`` (entrypoints/launchers/api_server/routers.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import httpclient
from pdserve.doctor.logs import LogFacts, candidate_logs, read_log
from pdserve.doctor.report import PairReport
from pdserve.errors import ConfigError, MetricsUnreadable, Unreachable
from pdserve.prometheus import CACHE_CONFIG_INFO, XFER_COUNT, labels_of, parse_prometheus, scrape_text
from pdserve.tppairing import pair_tp

_TIMEOUT = 10.0


@dataclass
class InstanceFacts:
    role: str
    url: str
    state: str | None = None  # what the proxy says: serving, unhealthy, restarting, …
    is_healthy: bool | None = None
    model: str | None = None
    root: str | None = None
    max_model_len: int | None = None
    version: str | None = None
    cache: dict[str, str] | None = None  # vllm:cache_config_info labels
    metrics: dict[str, float] = field(default_factory=dict)  # at the time of gathering
    log: LogFacts | None = None
    log_note: str | None = None  # why no log is used, when none is
    error: str | None = None  # why the instance could not be read at all

    @property
    def has_nixl_metrics(self) -> bool:
        return XFER_COUNT in self.metrics

    @property
    def block_size(self) -> int | None:
        value = (self.cache or {}).get("block_size", "")
        return int(value) if value.isdigit() else None


def _get(url: str) -> tuple[int, Any]:
    response = httpclient.get(url, _TIMEOUT)
    return response.status, response.json()


def gather(role: str, url: str, listing: dict[str, Any] | None = None) -> InstanceFacts:
    facts = InstanceFacts(role, url)
    if listing:
        facts.state, facts.is_healthy = listing.get("state"), listing.get("healthy")
    try:
        status, models = _get(f"{url}/v1/models")
        if status == 200 and isinstance(models, dict) and models.get("data"):
            first = models["data"][0]
            facts.model, facts.root = first.get("id"), first.get("root")
            facts.max_model_len = first.get("max_model_len")
        else:
            facts.error = f"{url}/v1/models answered {status}"
            return facts
        status, version = _get(f"{url}/version")
        if status == 200 and isinstance(version, dict):
            facts.version = version.get("version")
    except Unreachable as exc:
        facts.error = str(exc)
        return facts
    # An instance that serves its API but no /metrics is still one to check: its facts stay unknown.
    with contextlib.suppress(MetricsUnreadable):
        text = scrape_text(url, _TIMEOUT)
        facts.metrics, facts.cache = parse_prometheus(text), labels_of(text, CACHE_CONFIG_INFO)
    return facts


def attach_log(facts: InstanceFacts, dirs: list[Path], since: float, engine_id: str | None) -> None:
    """Find the live instance's log among the run dirs. An older run on the same port left a log with
    the same header, so a candidate counts only if it names the engine id prefill just answered with
    (prefill) or was written to during the canary (decode: vLLM logs every request it serves)."""
    candidates = candidate_logs(facts.url, dirs)
    if not candidates:
        facts.log_note = "no log found" + (f" under {', '.join(map(str, dirs))}" if dirs else " (no --logs)")
        return
    for path in candidates:
        log = read_log(path)
        if engine_id is not None and log.engine_ids:
            if log.engine_id == engine_id:
                facts.log = log
                return
            continue
        if path.stat().st_mtime >= since:
            facts.log = log
            return
    facts.log_note = f"{len(candidates)} log(s) for this port, none of this running instance"


def _agree(pair: PairReport, what: str, p: object, d: object, why: str = "") -> None:
    # Unknown is a warning, not a failure: the sides may well agree, nothing here can tell.
    if p is None and d is None:
        pair.add("warn", f"{what}: unknown on both sides{why}")
    elif p is None or d is None:
        pair.add("warn", f"{what}: prefill {p or 'unknown'}, decode {d or 'unknown'}{why}")
    else:
        pair.check(p == d, f"{what} agrees: {p}" if p == d else f"{what} differs: prefill {p}, decode {d}")


def compare(pair: PairReport, p: InstanceFacts, d: InstanceFacts) -> None:
    """Checks that prefill and decode can exchange KV at all: same model, shapes and layout."""
    _agree(pair, "model", p.model, d.model)
    if p.root != d.root:
        pair.add("warn", f"model path differs: prefill {p.root}, decode {d.root} (same weights?)")
    _agree(pair, "max_model_len", p.max_model_len, d.max_model_len)
    _agree(pair, "vLLM version", p.version, d.version)
    _agree(pair, "KV block size", p.block_size, d.block_size, " (no vllm:cache_config_info)")
    _agree(pair, "KV cache dtype", (p.cache or {}).get("cache_dtype"), (d.cache or {}).get("cache_dtype"))
    caching = [(f.cache or {}).get("enable_prefix_caching") for f in (p, d)]
    if None not in caching and caching[0] != caching[1]:  # not a handoff problem, but routing's premise
        pair.add("warn", f"prefix caching differs: prefill {caching[0]}, decode {caching[1]}")
    pl, dl = p.log, d.log
    no_log = " (only the instance logs say: --logs RUN_DIR)"
    _agree(pair, "dtype", pl.dtype if pl else None, dl.dtype if dl else None, no_log)
    _agree(pair, "KV layout", pl.kv_layout if pl else None, dl.kv_layout if dl else None, no_log)
    tps = (pl.tensor_parallel_size, dl.tensor_parallel_size) if pl and dl else (None, None)
    if tps[0] and tps[1]:
        try:  # the model's KV heads are not in the log: the canary tries the rules that need them
            pair.add("info", f"tensor parallel: {pair_tp(tps[0], tps[1]).describe()}")
        except ConfigError as exc:
            pair.check(False, f"tensor parallel: {exc}")
    if pl and dl:
        _agree(pair, "attention backend", pl.attention_backends, dl.attention_backends)
        _agree(pair, "KV buffer device", pl.kv_buffer_device, dl.kv_buffer_device)
        # kv_consumer prefills too: an elastic pool's instances take either role (docs/elastic.md).
        roles = (
            ("prefill", pl, ("kv_producer", "kv_both", "kv_consumer")),
            ("decode", dl, ("kv_consumer", "kv_both")),
        )
        for role, log, wanted in roles:
            if log.kv_role is not None:
                pair.check(log.kv_role in wanted, f"{role}'s KV role is {log.kv_role}")
