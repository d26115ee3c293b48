"""A proxy of several worker processes (workers.py), as each worker's handlers see it: the one place
that asks the other workers, merges their answers and shares prefix-index picks with them.

Every worker serves the same app on the shared TCP port and on a Unix socket of its own in a private
directory. A request that comes in over a Unix socket is a peer's (``is_peer``): it is answered from
that worker's own state and never passed on. So what a client reads of the proxy (/metrics, /instances,
/requests, /admin/ledger) is the answering worker's state merged with its peers', and what the admin API
changes, every worker changes. Three things travel between workers unasked: what the launcher tells the
proxy (workers.py delivers it to each), the prefix index's new entries, in batches, so that a
prompt-aware policy in one worker knows where the others sent a prefix, and each push a decode waits for
in vain (so that the decode rests in every worker: instance.py).

A handler hands its own answer to the app's ``Fanout`` and gets the proxy's back, in one line. A proxy
of one process has ``Fanout`` itself, which hands the answer back and wraps no policy: nothing here runs
per request then. One worker of several has ``Peers``.

Peers are asked through the proxy's own HTTP client (proxy/wire/client.py, on each peer's Unix socket),
so a peer that fails to answer fails as an instance would, and is said, never passed over in silence:
each miss is logged and counted on /metrics (``pdserve_worker_misses_total``, by the worker asked); an
answer that lacks a worker's part names it in its ``X-Pdserve-Partial`` header (``partial_headers``), a
merged /metrics also in ``pdserve_workers_missing``, and /instances calls nothing drained then.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pdserve.asgi import Scope
from pdserve.config import ROLES, Role
from pdserve.errors import UpstreamError
from pdserve.proxy.pool.routing import C, Pick, Policy
from pdserve.proxy.serving.exposition import format_number
from pdserve.proxy.wire.client import Address, Client
from pdserve.proxy.wire.connection import RequestWriter

log = logging.getLogger("pdserve.proxy")

PEER_TIMEOUT_S = 2.0
PEER_REQUEST = RequestWriter("pdserve-worker")
_GOSSIP_S = 0.1  # how stale one worker's view of another's prefix index may be
_MAX_PICKS = 10_000  # picks kept for the next batch; beyond it the oldest go (the index is an estimate)
_MAX_ASKS = 64  # requests in flight to one peer at once; more wait their turn (within the timeout)
_NUM_RECENT = 256  # handoffs a merged /admin/ledger lists, as one worker's ledger keeps
PARTIAL_HEADER = "X-Pdserve-Partial"
_PARTIAL = "pdserve.partial"  # the scope's key for the workers an answer lacks (``partial_headers``)

Described = list[dict[str, Any]]  # Instance.describe() of each instance, as JSON reads it back


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")


def is_peer(scope: Scope) -> bool:
    """Whether the request came over a worker's Unix socket (uvicorn gives such a server no port)."""
    server = scope.get("server")
    return server is not None and server[1] is None


def partial_headers(request: Request) -> dict[str, str]:
    """Headers for the answer to ``request``: ``X-Pdserve-Partial`` names each worker whose part it lacks,
    and why; none when the answer is whole (always, for a proxy of one process)."""
    missing = request.scope.get(_PARTIAL)
    return {PARTIAL_HEADER: "; ".join(missing)} if missing else {}


@dataclass
class Asked:
    """What the other workers made of one request."""

    answers: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # worker → (status, body)
    misses: dict[int, str] = field(default_factory=dict)  # worker → why no answer came

    def missing(self, wanted: Container[int]) -> list[str]:
        """Each worker that did not answer, or answered a status not ``wanted``, and why, as a header
        carries it."""
        said = list(self.misses.items())
        said += [(i, f"answered {status}") for i, (status, _) in self.answers.items() if status not in wanted]
        return [
            f"worker {i}: " + why.encode("ascii", "replace").decode().translate(_ONE_LINE) for i, why in said
        ]

    def bodies(self, request: Request) -> list[bytes]:
        """The bodies of the 200 answers; every other worker is noted as missing from ``request``'s."""
        if missing := self.missing((200,)):
            request.scope.setdefault(_PARTIAL, []).extend(missing)
        return [body for status, body in self.answers.values() if status == 200]


_ONE_LINE = str.maketrans("\r\n", "  ")


class Fanout:
    """The proxy is one process: its own answer is the proxy's, and no pick is shared."""

    def sharing(self, role: Role, policy: Policy) -> Policy:
        """The policy to route ``role`` with: ``policy``, or it telling the other workers its picks."""
        return policy

    async def instances(self, request: Request, own: Described) -> Described:
        """Each instance as this worker sees it, with the requests every worker has in flight there."""
        return own

    async def requests(self, request: Request, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every worker's recent requests (``Trace.as_dict``), oldest first."""
        return own

    async def metrics(self, request: Request, own: str) -> str:
        """Every worker's Prometheus text (metrics.py) as one."""
        return own

    async def ledger(self, request: Request, own: dict[str, Any]) -> dict[str, Any]:
        """Every worker's ``Ledger.snapshot`` as one."""
        return own

    async def repeat(self, request: Request, response: Response) -> None:
        """This worker made the admin change ``request`` asked for (``response``): so do the others."""
        return None

    async def run(self) -> None:
        """What the fan-out does in the background while the app serves (its lifespan cancels it)."""
        return None


class Peers(Fanout):
    """The workers other than this one (``index`` of ``count``), over their Unix sockets."""

    def __init__(self, directory: str, index: int, count: int, timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.directory = directory
        self.index = index
        self.count = count
        self._timeout_s = timeout_s
        self._paths = {i: socket_path(directory, i) for i in range(count) if i != index}
        self._clients: dict[int, Client] = {}  # opened on the loop of the first ask
        self._misses: Counter[int] = Counter({i: 0 for i in self._paths})  # by the worker asked
        self._picks: list[dict[str, Any]] = []
        self._is_sharing = False  # a prompt-aware policy tells its picks (``sharing``)
        self._telling: set[asyncio.Task[None]] = set()

    # --- what handlers call ----------------------------------------------------------------------

    def sharing(self, role: Role, policy: Policy) -> Policy:
        if not policy.wants_prompt:
            return policy
        self._is_sharing = True
        return _SharingPolicy(role, policy, self._share_pick)

    async def instances(self, request: Request, own: Described) -> Described:
        if is_peer(request.scope):
            return own
        others = [orjson.loads(b) for b in await self._same_of_others(request)]
        return merge_descriptions(own, others, is_whole=len(others) == len(self._paths))

    async def requests(self, request: Request, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if is_peer(request.scope):
            return own
        found = own + [t for b in await self._same_of_others(request) for t in orjson.loads(b)["requests"]]
        return sorted(found, key=lambda t: t["started"])  # oldest first, as one worker lists them

    async def metrics(self, request: Request, own: str) -> str:
        if is_peer(request.scope):
            return own + self._misses_text()
        others = [b.decode() for b in await self._same_of_others(request)]
        merged = merge_metrics([own + self._misses_text(), *others])
        return merged + _metric(
            "pdserve_workers_missing", "gauge",
            "Proxy workers whose part this answer lacks: they did not answer the worker that was asked in time.",
            [("", len(self._paths) - len(others))],
        )  # fmt: skip

    async def ledger(self, request: Request, own: dict[str, Any]) -> dict[str, Any]:
        if is_peer(request.scope):
            return own
        return merge_snapshots([own, *(orjson.loads(b) for b in await self._same_of_others(request))])

    async def repeat(self, request: Request, response: Response) -> None:
        if is_peer(request.scope) or response.status_code >= 300:
            return
        sent = await request.body()
        asked = await self.ask(request.method, request.url.path, sent, _credentials(request))
        self._log_refusals(asked, request.method, request.url.path)
        if missing := asked.missing(range(200, 300)):  # made here: the client must know where it was not
            response.headers[PARTIAL_HEADER] = "; ".join(missing)

    def tell_stranded(self, url: str) -> None:
        """This worker saw a push to decode ``url`` that never came: the others count it too, at once
        (ProxyState.push_stranded)."""

        async def tell() -> None:
            body = orjson.dumps({"url": url})
            self._log_refusals(
                await self.ask("POST", "/_pdserve/stranded", body), "POST", "/_pdserve/stranded"
            )

        task = asyncio.create_task(tell())
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def run(self) -> None:
        """Send the picks of each ``_GOSSIP_S`` to the peers, until cancelled."""
        while self._is_sharing:
            await asyncio.sleep(_GOSSIP_S)
            if self._picks:
                batch, self._picks = self._picks, []
                self._log_refusals(await self.ask("POST", "/_pdserve/prefix", orjson.dumps(batch)), "POST",
                                   "/_pdserve/prefix")  # fmt: skip

    # --- asking ----------------------------------------------------------------------------------

    async def ask(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Asked:
        """Every peer's answer, whatever its status. A peer that gives none within the timeout is left
        out, logged and counted (``Asked.misses``): a read then shows fewer workers' state and says so,
        never blocks on a stuck one."""
        # Written once, before anything is sent: a header that would split the request raises here.
        request = PEER_REQUEST(method.encode("ascii"), path, {**(headers or {}), "Connection": "close"}, body)
        clients = await self._open_clients()
        results = await asyncio.gather(
            *(c.exchange(request, "worker", self._timeout_s) for c in clients.values()),
            return_exceptions=True,
        )
        asked = Asked()
        for i, result in zip(clients, results, strict=True):
            if isinstance(result, UpstreamError):
                asked.misses[i] = result.detail
                self._misses[i] += 1
                log.warning("worker %d: no answer from worker %d for %s %s: %s", self.index, i, method,
                            path, result.detail)  # fmt: skip
            elif isinstance(result, BaseException):
                raise result
            else:
                asked.answers[i] = (result.status, result.body)
        return asked

    async def _same_of_others(self, request: Request) -> list[bytes]:
        """The bodies of the peers' 200 answers to the same GET, with the client's credentials; the
        others are named in the answer's ``partial_headers``."""
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return (await self.ask("GET", target, None, _credentials(request))).bodies(request)

    async def _open_clients(self) -> dict[int, Client]:
        if not self._clients:
            clients = {i: Client(f"unix:{path}", Address(path=path), PEER_REQUEST, self._timeout_s, _MAX_ASKS)
                       for i, path in self._paths.items()}  # fmt: skip
            for client in clients.values():
                await client.open()
            self._clients = clients
        return self._clients

    def _log_refusals(self, asked: Asked, method: str, path: str) -> None:
        for i, (status, body) in asked.answers.items():
            if status >= 300:
                log.warning("worker %d: worker %d refused %s %s: %s %s", self.index, i, method, path, status,
                            body[:300])  # fmt: skip

    def _misses_text(self) -> str:
        return _metric(
            "pdserve_worker_misses_total", "counter",
            "Requests of one proxy worker to another (merged reads, admin changes, shared picks) that got "
            "no answer, by the worker asked.",
            [(f'{{worker="{i}"}}', n) for i, n in sorted(self._misses.items())],
        )  # fmt: skip

    def _share_pick(self, role: Role, url: str, hashes: Sequence[int]) -> None:
        """This worker sent a prompt with these block hashes to ``url``: the others learn it soon."""
        self._picks.append({"role": role, "url": url, "hashes": list(hashes)})
        if len(self._picks) > _MAX_PICKS:
            del self._picks[: len(self._picks) - _MAX_PICKS]


def read_picks(body: bytes) -> list[tuple[Role, str, list[int]]]:
    """Another worker's batch of picks (``Peers.run``) as (role, url, block hashes); ValueError if the
    body is not such a batch. A pick of an unknown role, or with a URL that is not text, is skipped."""
    try:
        return [
            (p["role"], p["url"], p["hashes"])
            for p in orjson.loads(body)
            if p["role"] in ROLES and isinstance(p["url"], str) and isinstance(p["hashes"], list)
        ]
    except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
        raise ValueError(f"not a list of picks: {exc}") from None


def _metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += (f"{name}{labels} {format_number(value)}" for labels, value in samples)
    return "\n".join(lines) + "\n"


def _credentials(request: Request) -> dict[str, str]:
    """The client's credentials, for a peer worker's answer to the same question."""
    given = request.headers.get("authorization")
    return {"Authorization": given} if given else {}


class _SharingPolicy:
    """A prompt-aware policy whose picks the other workers learn (``Peers.run`` sends them)."""

    def __init__(self, role: Role, policy: Policy, share: Callable[[Role, str, Sequence[int]], None]) -> None:
        self._role = role
        self._policy = policy
        self._share = share

    @property
    def wants_prompt(self) -> bool:
        return self._policy.wants_prompt

    def pick(self, candidates: Sequence[C], prompt: Sequence[int] | None = None) -> Pick[C]:
        pick = self._policy.pick(candidates, prompt)
        if prompt:
            self._share(self._role, pick.instance.url, prompt)
        return pick

    def forget(self, url: str) -> None:
        self._policy.forget(url)

    def learn(self, url: str, prompt: Sequence[int]) -> None:
        self._policy.learn(url, prompt)


# --- merging the workers' answers ------------------------------------------------------------------


def merge_descriptions(own: Described, others: Sequence[Described], is_whole: bool = True) -> Described:
    """This worker's view of its instances, with the requests every worker has in flight at each and
    the KV each holds for every worker's decodes (so drained means drained for the whole proxy). Without
    every worker's view (``is_whole`` false) nothing is drained: a worker that did not answer may still
    have requests there."""
    sums: dict[str, Counter[object]] = {"in_flight": Counter(), "kv_held": Counter()}
    for view in others:
        for d in view:
            for key, counts in sums.items():
                count = d.get(key)
                if isinstance(count, int):
                    counts[d.get("url")] += count
    merged = []
    for d in own:
        totals = {}
        for key, counts in sums.items():
            count = d.get(key)
            totals[key] = (count if isinstance(count, int) else 0) + counts[d.get("url")]
        drained = is_whole and bool(d.get("draining")) and not totals["in_flight"] and not totals["kv_held"]
        merged.append({**d, **totals, "drained": drained})
    return merged


def merge_snapshots(snapshots: Sequence[dict[str, Any]], num_recent: int = _NUM_RECENT) -> dict[str, Any]:
    """Several workers' ``Ledger.snapshot`` as one: counts summed, handoffs side by side (the newest
    recent ones first, at most ``num_recent``)."""
    first = snapshots[0]
    abandoned: Counter[str] = Counter()
    suspects: Counter[str] = Counter()
    for snap in snapshots:
        abandoned.update(snap["abandoned"])
        suspects.update(snap["suspect"])
    recent = sorted((h for snap in snapshots for h in snap["recent"]), key=lambda h: h["age_s"])
    return {
        "lease_s": first["lease_s"],
        "issued": sum(s["issued"] for s in snapshots),
        "delivered": sum(s["delivered"] for s in snapshots),
        "abandoned": dict(abandoned),
        "suspect": dict(suspects),
        "open": [h for snap in snapshots for h in snap["open"]],
        "overdue": sum(s["overdue"] for s in snapshots),
        "recent": recent[:num_recent],
    }


# Per-instance states, not counts: several workers' views merge to 1 only where every one says 1.
_ALL_OF = frozenset({"pdserve_instance_healthy", "pdserve_instance_available"})
# Estimates each worker makes of one instance: the most cautious one stands.
# (Every worker counts each stranded push: each has the whole count, and the most is the freshest.)
_MOST_OF = frozenset({"pdserve_decode_expected_pull_seconds", "pdserve_instance_stranded_pushes"})


def merge_metrics(texts: Sequence[str]) -> str:
    """Several workers' Prometheus texts as one: a sample present in several is summed (counts,
    in-flight gauges, histogram buckets), but for the per-instance states in ``_ALL_OF`` (the least) and
    the estimates in ``_MOST_OF`` (the most)."""
    families: dict[str, tuple[list[str], dict[str, float]]] = {}
    current: dict[str, float] = {}
    name = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                if name not in families:
                    families[name] = ([line], {})
                current = families[name][1]
            elif line.startswith("# TYPE "):
                meta = families[name][0]
                if len(meta) == 1:
                    meta.append(line)
            elif line:
                key, _, value = line.rpartition(" ")
                number = float(value)
                if key in current and name in _ALL_OF:
                    current[key] = min(current[key], number)
                elif key in current:
                    current[key] = max(current[key], number) if name in _MOST_OF else current[key] + number
                else:
                    current[key] = number
    lines = []
    for meta, samples in families.values():
        lines += meta
        lines += (f"{key} {format_number(value)}" for key, value in samples.items())
    return "\n".join(lines) + "\n"
