"""`pdserve top URL`: a live view of the instances behind a pdserve proxy, redrawn in place.

Each refresh makes plain GETs that change nothing: the proxy's ``/instances`` (role, state, circuit, in
flight: what its health checks last saw), the proxy's ``/metrics`` (request outcomes, retries, KV
handoffs) and every instance's own ``/metrics`` (running, waiting, KV usage, NIXL counters). Rates are
counter deltas between two refreshes, so the first live frame has none and ``--once`` samples twice, one
interval apart, before it prints.

The frame is a pure function of two snapshots (``render``); only ``run`` touches the terminal. On a TTY
it redraws in place with ANSI (cursor home, clear to end of line, clear below), which every terminal
understands without curses; anywhere else (a pipe, a log file) each frame follows the last.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, TextIO

from pdserve import httpclient
from pdserve.errors import MetricsUnreadable, Unreachable
from pdserve.prometheus import EngineScrape, parse_samples, scrape, scrape_text

# The proxy's outcomes (proxy/pool/state.py Outcome) in the order an operator reads them; others follow.
_OUTCOMES = ("ok", "client_error", "error", "stream_error", "client_disconnected")
_HANDOFFS = ("open", "overdue", "issued", "delivered", "abandoned", "suspect")


@dataclass(frozen=True)
class InstanceRow:
    """One entry of the proxy's GET /instances."""

    role: str
    url: str
    state: str  # serving, unhealthy, restarting, draining, removed
    circuit: str  # closed, open, half_open
    num_in_flight: int
    error: str | None = None  # the last failure the proxy saw
    side: str | None = None  # an elastic pool's instance (role "elastic"): the side the router gives it now

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> InstanceRow:
        return cls(str(entry.get("role", "?")), str(entry.get("url", "?")), str(entry.get("state", "?")),
                   str(entry.get("circuit", "?")), int(entry.get("in_flight") or 0), entry.get("error"),
                   entry.get("side"))  # fmt: skip

    @property
    def label(self) -> str:
        """The ROLE cell: an elastic instance shows the side it leans to now (elastic/prefill)."""
        return f"{self.role}/{self.side}" if self.side else self.role


@dataclass(frozen=True)
class ProxyScrape:
    """The proxy's own /metrics, grouped the way the header shows them."""

    outcomes: Mapping[str, float] = field(default_factory=dict)  # summed over endpoints
    retries: Mapping[str, float] = field(default_factory=dict)  # by phase
    num_running: float = 0.0
    num_queued: float = 0.0
    num_rejected: float = 0.0
    handoffs: Mapping[str, float] = field(default_factory=dict)  # _HANDOFFS, each over every reason
    elastic: ElasticScrape | None = None  # an elastic pool's router, when the proxy runs one

    @property
    def num_requests(self) -> float:
        return sum(self.outcomes.values())

    @classmethod
    def parse(cls, text: str) -> ProxyScrape:
        outcomes: dict[str, float] = {}
        retries: dict[str, float] = {}
        handoffs = dict.fromkeys(_HANDOFFS, 0.0)
        gauges: dict[str, float] = {}
        layout, placements, factors, sources = None, {}, {}, {}
        for s in parse_samples(text):
            if s.name.startswith("pdserve_elastic_"):
                if s.name == "pdserve_elastic_layout_info":
                    layout = s.labels.get("layout", "?")
                elif s.name == "pdserve_elastic_placements_total":
                    placements[s.labels.get("placement", "?")] = s.value
                elif s.name == "pdserve_elastic_calibration_factor":
                    factors[(s.labels.get("kind", "?"), s.labels.get("metric", "?"))] = s.value
                elif s.name == "pdserve_elastic_calibration_source" and s.value:
                    sources[s.labels.get("kind", "?")] = s.labels.get("source", "?")
            elif s.name == "pdserve_requests_total":
                key = s.labels.get("outcome", "?")
                outcomes[key] = outcomes.get(key, 0.0) + s.value
            elif s.name == "pdserve_retries_total":
                retries[s.labels.get("phase", "?")] = s.value
            elif s.name == "pdserve_kv_handoffs_total" and s.labels.get("state") in handoffs:
                handoffs[s.labels["state"]] += s.value
            elif s.name == "pdserve_kv_handoffs_suspect_total":
                handoffs["suspect"] += s.value
            else:
                gauges[s.name] = gauges.get(s.name, 0.0) + s.value
        handoffs["open"] = gauges.get("pdserve_kv_handoffs_open", 0.0)
        handoffs["overdue"] = gauges.get("pdserve_kv_handoffs_overdue", 0.0)
        elastic = ElasticScrape(layout, placements, factors, sources) if layout is not None else None
        return cls(outcomes, retries, gauges.get("pdserve_requests_running", 0.0),
                   gauges.get("pdserve_requests_queued", 0.0), gauges.get("pdserve_requests_rejected_total", 0.0),
                   handoffs, elastic)  # fmt: skip


@dataclass(frozen=True)
class ElasticScrape:
    """What the proxy's /metrics say of its elastic router: the layout, placements so far, and the
    factors what streams measured puts on the cost model, by (kind, metric)."""

    layout: str
    placements: Mapping[str, float]
    factors: Mapping[tuple[str, str], float]
    # Per kind, what the factors come from: "requests", "startup" (measured before the first request) or
    # "model"; empty from a proxy that does not say.
    sources: Mapping[str, str] = field(default_factory=dict)

    def line(self) -> str:
        placed = "  ".join(f"{k} {n:g}" for k, n in sorted(self.placements.items()))
        factors = "  ".join(
            f"{kind} TTFT x{self.factors[(kind, 'ttft')]:.2g} TPOT x{self.factors[(kind, 'tpot')]:.2g}"
            + (f" ({self.sources[kind]})" if kind in self.sources else "")
            for kind in ("whole", "split")
            if (kind, "ttft") in self.factors and (kind, "tpot") in self.factors
        )
        return f"elastic   layout {self.layout}  placed: {placed or 'none'}" + (
            f"     measured/model: {factors}" if factors else ""
        )


@dataclass(frozen=True)
class Snapshot:
    """Everything one refresh read."""

    proxy_url: str
    at: float  # time.monotonic(): rates divide by differences of it
    wall: float  # time.time(), for the clock in the header
    instances: tuple[InstanceRow, ...] = ()
    engines: Mapping[str, EngineScrape | str] = field(default_factory=dict)  # by URL; str: why it failed
    proxy: ProxyScrape | None = None
    proxy_error: str | None = None  # the proxy itself could not be read


def _scrape_engine(url: str, timeout: float) -> EngineScrape | str:
    try:
        return EngineScrape.of(scrape(url, timeout))
    except MetricsUnreadable as exc:
        return str(exc)


def sample(proxy_url: str, pool: ThreadPoolExecutor, timeout: float = 2.0) -> Snapshot:
    """One refresh: the proxy's view, then every instance's /metrics in parallel (dozens of sims must
    not take dozens of timeouts)."""
    base = proxy_url.rstrip("/")
    at, wall = time.monotonic(), time.time()
    metrics = pool.submit(scrape_text, base, timeout)  # meanwhile, /instances
    try:
        listing = httpclient.get(f"{base}/instances", timeout)
        if listing.status != 200:
            raise Unreachable(f"{base}/instances answered {listing.status}")
        instances = tuple(InstanceRow.of(entry) for entry in listing.json())
        proxy = ProxyScrape.parse(metrics.result())
    # Not a pdserve proxy: /metrics unreadable, or /instances not a list of objects.
    except (Unreachable, MetricsUnreadable, TypeError, AttributeError) as exc:
        return Snapshot(base, at, wall, proxy_error=str(exc) or type(exc).__name__)
    urls = [i.url for i in instances]
    engines = dict(zip(urls, pool.map(lambda u: _scrape_engine(u, timeout), urls), strict=True))
    return Snapshot(base, at, wall, instances, engines, proxy)


# --- The frame ------------------------------------------------------------------------------------


def _rate(now: float | None, before: float | None, dt: float | None) -> float | None:
    """Per second between two scrapes; None without both, or when it fell (a restarted engine)."""
    if now is None or before is None or not dt or now < before:
        return None
    return (now - before) / dt


def _n(value: float | None, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def _proxy_lines(now: ProxyScrape, before: ProxyScrape | None, dt: float | None) -> list[str]:
    rate = _rate(now.num_requests, before.num_requests if before else None, dt)
    parts = []
    for name in (*_OUTCOMES, *sorted(set(now.outcomes) - set(_OUTCOMES))):
        count = now.outcomes.get(name, 0.0)
        grew = count - before.outcomes.get(name, 0.0) if before else 0.0
        # New failures are what an operator looks for; the ok count grows all the time.
        parts.append(f"{name} {count:g}" + (f" (+{grew:g})" if grew > 0 and name != "ok" else ""))
    retries = "  ".join(f"{p} {n:g}" for p, n in sorted(now.retries.items())) or "none"
    handoffs = "  ".join(f"{k} {now.handoffs.get(k, 0.0):g}" for k in _HANDOFFS)
    return [
        f"requests  {_n(rate, '{:.1f}')}/s   " + "  ".join(parts),
        f"admission running {now.num_running:g}  queued {now.num_queued:g}  rejected {now.num_rejected:g}"
        f"     retries: {retries}",
        f"KV        handoffs {handoffs}",
        *([now.elastic.line()] if now.elastic is not None else []),
    ]


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False  # numbers line up on their last digit


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows under their headers, each column as wide as its widest cell."""
    widths = [max(len(c.header), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(w) if c.right else cell.ljust(w)
            for c, w, cell in zip(columns, widths, cells, strict=True)
        ).rstrip()

    return [line([c.header for c in columns]), *(line(r) for r in rows)]


_COLUMNS = (Column("ROLE"), Column("URL"), Column("STATE"), Column("CIRCUIT"), Column("INFL", right=True),
            Column("RUN", right=True), Column("WAIT", right=True), Column("KV%", right=True),
            Column("XFER/S", right=True), Column("GB/S", right=True), Column("MS/XFER", right=True),
            Column("XFERS", right=True), Column("FAILED", right=True), Column("EXPIRED", right=True))  # fmt: skip


# Each NIXL counter moves on one role only (docs/vllm-kv-lifecycle.md §6): the other role's cells stay
# blank rather than show a zero that reads like a measurement.
_ONLY_ON = {"transfers_per_s": "decode", "gb_per_s": "decode", "ms_per_transfer": "decode",
            "num_transfers": "decode", "num_failed": "decode", "num_expired": "prefill"}  # fmt: skip
_FORMATS = {
    "kv_percent": "{:.1f}",
    "transfers_per_s": "{:.1f}",
    "ms_per_transfer": "{:.1f}",
}
_NOT_ADDITIVE = ("kv_percent", "ms_per_transfer")


def _gb(value: float) -> str:
    """Two significant digits, never an exponent: a tiny model moves 0.00004 GB/s, a GPU link 20."""
    if value >= 0.1 or value <= 0:
        return f"{value:.2f}"
    return f"{value:.{1 - math.floor(math.log10(value))}f}"


@dataclass(frozen=True)
class _Figures:
    """One row's numbers, in column order; None: not known (no earlier scrape, or not exported)."""

    num_in_flight: float | None = None
    num_running: float | None = None
    num_waiting: float | None = None
    kv_percent: float | None = None
    transfers_per_s: float | None = None
    gb_per_s: float | None = None
    ms_per_transfer: float | None = None
    num_transfers: float | None = None
    num_failed: float | None = None
    num_expired: float | None = None

    def shows(self, role: str, name: str) -> bool:
        return role in ("all", "elastic") or _ONLY_ON.get(name, role) == role

    def cells(self, role: str) -> list[str]:
        """``role`` "all": the totals row, blank where nothing was summed."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if not self.shows(role, f.name):
                out.append("")
            elif value is None:
                out.append("" if role == "all" else "-")
            else:
                out.append(_gb(value) if f.name == "gb_per_s" else _FORMATS.get(f.name, "{:g}").format(value))
        return out


def _figures(inst: InstanceRow, now: EngineScrape, before: EngineScrape | None, dt: float | None) -> _Figures:
    old = before or EngineScrape()
    transfers = _rate(now.num_transfers, old.num_transfers, dt)
    num_bytes = _rate(now.num_bytes, old.num_bytes, dt)
    seconds = _rate(now.transfer_seconds, old.transfer_seconds, dt)
    return _Figures(
        num_in_flight=inst.num_in_flight,
        num_running=now.num_running,
        num_waiting=now.num_waiting,
        kv_percent=None if now.kv_usage is None else 100 * now.kv_usage,
        transfers_per_s=transfers,
        gb_per_s=None if num_bytes is None else num_bytes / 1e9,
        ms_per_transfer=1000 * seconds / transfers if seconds is not None and transfers else None,
        num_transfers=now.num_transfers,
        num_failed=now.num_failed,
        num_expired=now.num_expired,
    )


def _total(rows: Sequence[tuple[str, _Figures]]) -> _Figures:
    """The sums an operator would add up in their head, over the cells the rows show."""
    sums: dict[str, float] = {}
    for role, row in rows:
        for f in fields(row):
            value = getattr(row, f.name)
            if value is not None and f.name not in _NOT_ADDITIVE and row.shows(role, f.name):
                sums[f.name] = sums.get(f.name, 0.0) + value
    return _Figures(**sums)


def render(now: Snapshot, before: Snapshot | None = None) -> list[str]:
    """The frame for ``now``; rates over the time since ``before`` (none without it)."""
    dt = now.at - before.at if before is not None else None
    clock = time.strftime("%H:%M:%S", time.localtime(now.wall))
    window = f"rates over {dt:.1f} s" if dt else "rates from the next refresh"
    lines = [f"pdserve top  {now.proxy_url}  {clock}  {window}", ""]
    if now.proxy is None:
        return [*lines, f"proxy unreachable: {now.proxy_error}"]
    lines += [*_proxy_lines(now.proxy, before.proxy if before else None, dt), ""]
    rows, figures, notes = [], [], []
    for inst in now.instances:
        head = [inst.label, inst.url, inst.state, inst.circuit]
        engine = now.engines.get(inst.url)
        if isinstance(engine, EngineScrape):
            old = before.engines.get(inst.url) if before else None
            f = _figures(inst, engine, old if isinstance(old, EngineScrape) else None, dt)
            figures.append((inst.role, f))
            rows.append([*head, *f.cells(inst.role)])
        else:  # its /metrics could not be read: what the proxy knows, then "?"
            figures.append((inst.role, _Figures(num_in_flight=inst.num_in_flight)))
            rows.append([*head, str(inst.num_in_flight), *["?"] * (len(_COLUMNS) - len(head) - 1)])
            notes.append(f"! {inst.url} /metrics: {engine or 'not read'}")
        if inst.error and inst.state != "serving":
            notes.append(f"! {inst.url} {inst.state}: {inst.error}")
    rows.append(["all", f"{len(now.instances)} instances", "", "", *_total(figures).cells("all")])
    return [*lines, *table(_COLUMNS, rows), *notes]


# --- The terminal ---------------------------------------------------------------------------------

_HOME, _CLEAR_LINE, _CLEAR_BELOW, _CLEAR_SCREEN = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def _fit(lines: Sequence[str], columns: int, rows: int) -> list[str]:
    """Lines cut to the screen: a wrapped or scrolled line would break the next redraw in place."""
    cut = [line[:columns] for line in lines]
    if len(cut) >= rows:
        hidden = len(cut) - (rows - 2)
        cut = [*cut[: rows - 2], f"… {hidden} more lines: enlarge the terminal, or use --once"[:columns]]
    return cut


def run(proxy_url: str, interval_s: float = 2.0, once: bool = False, out: TextIO | None = None,
        pause: Callable[[float], None] = time.sleep) -> int:  # fmt: skip
    """Print frames until Ctrl-C; with ``once``, a single frame whose rates span one interval.

    ``pause`` waits between the samples (tests drive traffic in it)."""
    out = out or sys.stdout
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="pdserve-top") as pool:
        timeout = max(0.5, min(interval_s, 5.0))
        if once:
            first = sample(proxy_url, pool, timeout)
            if first.proxy is None:
                raise Unreachable(f"cannot read the proxy at {proxy_url}: {first.proxy_error}")
            pause(interval_s)
            out.write("\n".join(render(sample(proxy_url, pool, timeout), first)) + "\n")
            return 0
        in_place = out.isatty()
        if in_place:
            out.write(_HIDE_CURSOR + _CLEAR_SCREEN)
        previous: Snapshot | None = None
        try:
            while True:
                current = sample(proxy_url, pool, timeout)
                lines = render(current, previous if previous and previous.proxy else None)
                if in_place:
                    size = shutil.get_terminal_size()
                    body = "".join(
                        line + _CLEAR_LINE + "\n" for line in _fit(lines, size.columns, size.lines)
                    )
                    out.write(_HOME + body + _CLEAR_BELOW)
                else:
                    out.write("\n".join(lines) + "\n\n")
                out.flush()
                previous = current
                pause(max(0.0, interval_s - (time.monotonic() - current.at)))
        except KeyboardInterrupt:
            return 0
        finally:
            if in_place:
                out.write(_SHOW_CURSOR)
                out.flush()
