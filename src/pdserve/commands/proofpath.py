"""Where verify's proof reaches: the reference instance (directly, or through the proxy where only the
proxy is reachable) and the proxy's own record of whether it split a request.

A deployment that exposes only the proxy (a Kubernetes port-forward, or decodes firewalled to the proxy
as docs/kv-integrity.md advises) still gets the whole proof: the proxy serves one named instance's whole
answer on request (``X-Pdserve-Whole-On``, proxy/request/wholeon.py), the reference the PD answers are scored
against. Only the KV block size is then unknown, and the largest default is assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve import httpclient, kvproof
from pdserve.errors import MetricsUnreadable, NoAnswer, Unreachable
from pdserve.prometheus import CACHE_CONFIG_INFO, labels_of, scrape_text

_REACH_TIMEOUT = 3.0


@dataclass(frozen=True)
class Reference:
    """The instance that scores answers alone: ``base`` to post to, with ``headers`` (through the proxy)."""

    base: str
    name: str
    headers: dict[str, str] | None = None
    block_size: int | None = None  # the engine's KV block size, where its /metrics could be read


def _block_size(url: str) -> int | None:
    try:
        labels = labels_of(scrape_text(url, _REACH_TIMEOUT), CACHE_CONFIG_INFO) or {}
    except (MetricsUnreadable, Unreachable):
        return None
    value = labels.get("block_size", "")
    return int(value) if value.isdigit() else None


def find_reference(
    proxy_url: str, instances: list[dict[str, Any]], admin_key: str | None, say: Callable[[str], None]
) -> Reference:
    """The first decode (or elastic) instance the proxy lists, asked directly if this host reaches it,
    else through the proxy; says which, and what could not be reached."""
    decoding = [i for i in instances if i["role"] in ("decode", "elastic")]
    url = str(decoding[0]["url"]).rstrip("/")
    who = f"{decoding[0]['role']} instance {url}"
    try:
        status = httpclient.get(f"{url}/health", _REACH_TIMEOUT).status
        why = None if status == 200 else f"/health answered {status}"
    except NoAnswer:  # reached, and busy: its answers come late, which verify waits for
        why = None
    except Unreachable as exc:
        why = str(exc)
    if why is None:
        return Reference(url, who, None, _block_size(url))
    say(
        f"cannot reach {who} from here ({why}): it scores the answers through the proxy "
        f"(X-Pdserve-Whole-On); its KV block size is unknown, {kvproof.DEFAULT_BLOCK_SIZE} assumed"
    )
    headers = {"X-Pdserve-Whole-On": url}
    if admin_key:
        headers["X-Pdserve-Admin-Key"] = admin_key
    return Reference(proxy_url, f"{who} (through the proxy)", headers, None)


@dataclass(frozen=True)
class Split:
    """What the proxy's /requests says of one request."""

    kept_whole: str | None = None  # why it was not split, if it was not
    moved: str | None = None  # where its stream went on mid-way, if it did
    unknown: str | None = None  # why the record could not be read
    # how the KV reached decode: pull, push, push concurrent (+ first token at once); None: not said
    handover: str | None = None


def split_of(proxy_url: str, request_id: str, admin_key: str | None) -> Split:
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    try:
        response = httpclient.request(f"{proxy_url}/requests?id={request_id}", timeout=10, headers=headers)
    except Unreachable as exc:
        return Split(unknown=str(exc))
    if response.status != 200:
        hint = ": give verify the admin key (--admin-key)" if response.status == 401 else ""
        return Split(unknown=f"/requests answered {response.status}{hint}")
    records = (response.json() or {}).get("requests") or []
    if not records:
        return Split(unknown=f"the proxy no longer holds request {request_id}'s record")
    record = records[0]
    placement = record.get("placement")
    if placement is not None:
        is_split = bool(placement.get("split"))
        why = placement.get("reason")
    else:
        is_split = record.get("kv_transfer_params") is not None
        why = record.get("local_prefill_reason")
    migrations = record.get("migrations") or []
    moved = "; ".join(
        f"from {m.get('from')} after {m.get('after_tokens')} tokens to {m.get('to')}" for m in migrations
    )
    handover = record.get("handover")
    return Split(
        None if is_split else str(why or "not split"),
        moved or None,
        handover=str(handover) if handover else None,
    )
