"""Keep a group's instances running: restart one that exits, with backoff, until it crash-loops.

One thread watches every instance of an ``EngineGroup`` and moves each through

    up ──exits──▶ waiting (backoff) ──respawned──▶ starting ──healthy──▶ up
                     ▲                               │ exits, or not healthy within the startup timeout
                     └───────────────────────────────┘
    more than ``max_restarts`` exits within ``window_s``: down, for good (the rest keep serving)

and reports each step as an ``InstanceEvent`` (exited, restarting, ready, gave_up) so the proxy takes the
instance out of service and back. Restarts happen on this one long-lived thread, never on a helper
thread: a child gets PR_SET_PDEATHSIG from the *thread* that spawned it (launcher.py), so a short-lived
thread would take the instance it restarted with it when it ends.

Two rules for GPUs. Instances that share a GPU (re)start one at a time, as the launcher starts them:
vLLM's memory profiling reads another process's allocations as its own. And a prefill whose restart
finds its GPU memory still taken gets it back by a restart of the decodes: a decode that read prefill's
KV over cuda_ipc keeps those buffers mapped, and the driver frees an exporter's memory only when every
importer has let go (measured on one H200: killing prefill freed 0.8 of its 64 GB, killing decode
freed all of it; UCX_CUDA_IPC_CACHE=n freed half, not enough). This is done once per outage.

One rule for push decodes: one that sits idle yet holds KV blocks for longer than its registration
watchdog holds blocks registered for a push that never came, which vLLM 0.32 frees only on a restart
(stranded.py): it is restarted, as it is idle, nothing in flight is lost. What waits there deferred
(a push's KV not yet come) counts as idle only when ``in_flight`` (the proxy's count of its requests
at that decode) says none is in flight: a restart would otherwise fail a push still on its way.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pdserve.engines.launcher import RUN_HEADER, EngineGroup
from pdserve.engines.placement import InstanceSpec
from pdserve.engines.stranded import DecodeLoad, InFlight, StrandedWatch, push_registration_timeout
from pdserve.errors import ConfigError, EngineStartError, MetricsUnreadable
from pdserve.events import InstanceEvent, InstanceEventKind
from pdserve.prometheus import scrape_text

log = logging.getLogger(__name__)

_STOP_JOIN_S = 10.0  # a tick takes at most one health check (2 s) and one spawn
_TAIL_LINES = 30
_BLOCKED_SAY_EVERY_S = 30.0  # how often a restart held up by lingering processes or ports says why
# uvicorn's access log ('INFO:     127.0.0.1:5000 - "GET /metrics HTTP/1.1" 200 OK'): every health check
# and scrape writes one, and a tail made of them says nothing about why the instance went down.
_ACCESS_LINE = re.compile(r'^INFO: +\S+:\d+ - "')


# vLLM's start-up check when the GPU lacks the memory --gpu-memory-utilization asks for (v1/worker/utils.py)
_GPU_MEMORY_HELD = re.compile(
    r"Free memory on device \S+ \(([\d.]+)/([\d.]+) GiB\) on startup is less than desired"
)


def restart_hint(log_tail: str) -> str | None:
    """What an operator should know about a failed (re)start that its log tail alone does not say."""
    found = _GPU_MEMORY_HELD.search(log_tail)
    if found is None:
        return None
    free, total = found.groups()
    return (
        f"only {free} of {total} GiB of its GPU are free: another process still holds the rest. Seen on one "
        "GPU shared with a decode after prefill was killed: decode keeps the dead prefill's KV mapped "
        "(cuda_ipc), so the memory stays allocated until that decode restarts (docs/gpu.md)"
    )


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff_s: float = 1.0  # wait before the first restart; doubles with each exit in the window
    max_backoff_s: float = 30.0
    max_restarts: int = 5  # restarts allowed within window_s; one more exit is a crash loop
    window_s: float = 600.0
    poll_s: float = 0.25  # how often exits and health are checked
    stranded_check_s: float = 2.0  # how often a push decode's counters are read for stranded blocks

    def __post_init__(self) -> None:
        for name in ("first_backoff_s", "max_backoff_s", "window_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"restart policy: {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_backoff_s < self.first_backoff_s:
            raise ConfigError(
                f"restart policy: max_backoff_s ({self.max_backoff_s}) is below first_backoff_s "
                f"({self.first_backoff_s})"
            )
        if self.max_restarts < 1:
            raise ConfigError(f"restart policy: max_restarts must be >= 1, got {self.max_restarts!r}")

    def backoff(self, num_recent_exits: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2.0 ** max(0, num_recent_exits - 1))


@dataclass
class _Watched:
    spec: InstanceSpec
    state: Literal["up", "waiting", "starting", "down"] = "up"
    exits: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    due: float = 0.0  # waiting: when to respawn; starting: when to give up waiting for health
    next_complaint: float = 0.0  # waiting past due: when to say again what holds the restart up
    exited_at: float = 0.0
    # A prefill whose restart found its GPU memory held: the decodes were restarted to free it, once
    # per outage (a second refusal means something else holds it; restarting decodes again would not help).
    has_freed_gpu: bool = False
    # A push decode: whether it holds blocks registered for a push that never came (None: not push).
    stranded: StrandedWatch | None = None
    next_stranded_check: float = 0.0


class Supervisor:
    """Restarts the instances of ``group`` that exit; ``start`` after the group started, ``stop`` first."""

    def __init__(
        self,
        group: EngineGroup,
        on_event: Callable[[InstanceEvent], None],
        say: Callable[[str], None] = print,
        policy: RestartPolicy | None = None,
        in_flight: InFlight | None = None,
    ) -> None:
        self._group = group
        self._on_event = on_event
        self._say = say
        self.policy = policy or RestartPolicy()
        self._in_flight = in_flight
        self._watched = [_Watched(spec, stranded=_stranded_watch(spec)) for spec in group.specs]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising, within a tick: a restart in progress is not waited for (the group's own
        ``stop`` ends the process). Instances this thread restarted get SIGTERM as it ends."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_STOP_JOIN_S)

    def _run(self) -> None:
        while not self._stopping.wait(self.policy.poll_s):
            try:
                self._tick()
            except Exception:  # this thread must outlive any one failure: its children die with it
                log.exception("supervisor tick failed")

    def _tick(self) -> None:
        exited = {spec.name for spec in self._group.exited()}
        for watched in self._watched:
            if self._stopping.is_set():
                return
            now = time.monotonic()
            is_exited = watched.spec.name in exited
            if watched.state == "up" and is_exited:
                watched.exited_at = now
                self._failed(watched, now, self._group.exit_status(watched.spec))
            elif watched.state == "waiting" and now >= watched.due:
                self._respawn(watched, now)
            elif watched.state == "starting":
                if is_exited:
                    self._failed(watched, now, f"{self._group.exit_status(watched.spec)} while restarting")
                elif self._group.is_healthy(watched.spec):
                    watched.state = "up"
                    watched.has_freed_gpu = False
                    if watched.stranded is not None:
                        watched.stranded.reset()
                    took = time.monotonic() - watched.exited_at
                    self._say(f"{watched.spec.name} is back, {took:.0f} s after it went down")
                    self._emit(watched, "ready", f"healthy {took:.1f} s after it went down")
                elif now > watched.due:
                    self._group.kill(watched.spec)
                    timeout = self._group.startup_timeout
                    self._failed(watched, now, f"not healthy {timeout:.0f} s after restart")
            elif (
                watched.state == "up" and watched.stranded is not None and now >= watched.next_stranded_check
            ):
                watched.next_stranded_check = now + self.policy.stranded_check_s
                self._check_stranded(watched, watched.stranded, now)

    def _failed(self, watched: _Watched, now: float, status: str) -> None:
        spec = watched.spec
        lines = [ln for ln in self._group.log_tail(spec, 400).splitlines() if not _ACCESS_LINE.match(ln)]
        tail = "\n".join(lines[-_TAIL_LINES:])
        # The cause may lie above vLLM's last traceback, but never in an earlier run of the same log.
        starts = [i for i, ln in enumerate(lines) if ln.startswith(RUN_HEADER)]
        hint = restart_hint("\n".join(lines[starts[-1] if starts else 0 :]))
        self._say(
            f"{spec.name} {status}; last lines of {self._group.log_path(spec)} (access log left out):\n{tail}"
            + (f"\n{spec.name}: {hint}" if hint else "")
        )
        self._emit(watched, "exited", status)
        # The API server may be gone while its engine core still holds the side channel and memory.
        self._group.kill(watched.spec)
        watched.exits.append(now)
        while watched.exits and watched.exits[0] < now - self.policy.window_s:
            watched.exits.popleft()
        if len(watched.exits) > self.policy.max_restarts:
            watched.state = "down"
            why = f"{len(watched.exits)} exits within {self.policy.window_s:.0f} s, the last: {status}"
            self._say(f"{watched.spec.name} is crash-looping ({why}); leaving it down, the rest keep serving")
            self._emit(watched, "gave_up", why)
            return
        delay = self.policy.backoff(len(watched.exits))
        self._wait(watched, now + delay)
        self._say(f"restarting {watched.spec.name} in {delay:g} s")
        if hint is not None and spec.role == "prefill" and spec.gpus and not watched.has_freed_gpu:
            watched.has_freed_gpu = True
            self._restart_decodes_holding(watched, now)

    def _restart_decodes_holding(self, prefill: _Watched, now: float) -> None:
        """Kill the running decodes on this host's GPUs, so that the driver frees what they kept mapped of
        the dead prefill's KV; they restart with it (GPU by GPU, one at a time). Not a crash of theirs."""
        for watched in self._watched:
            spec = watched.spec
            if spec.role != "decode" or not spec.gpus or watched.state not in ("up", "starting"):
                continue
            why = f"restarted to free {prefill.spec.name}'s GPU memory, which it kept mapped (cuda_ipc)"
            self._say(f"{spec.name} {why}")
            self._emit(watched, "exited", why)
            self._group.kill(spec)
            watched.exited_at = now
            self._wait(watched, prefill.due)  # prefill first, as the launcher starts them

    def _check_stranded(self, watched: _Watched, stranded: StrandedWatch, now: float) -> None:
        """Restart the push decode if it has sat idle holding blocks past its registration watchdog."""
        url, in_flight = watched.spec.url, self._in_flight
        try:
            load: DecodeLoad | None = DecodeLoad.parse(scrape_text(url, timeout=1.0))
        except MetricsUnreadable:
            load = None
        if not stranded.sample(load, now, lambda: in_flight(url) if in_flight is not None else None):
            return
        stranded.reset()
        why = (
            f"restarted to free KV blocks registered for a push that never came (idle, holding blocks for "
            f"over {stranded.timeout_s:g} s; vLLM frees them only when the push arrives)"
        )
        self._say(f"{watched.spec.name} {why}")
        self._emit(watched, "exited", why)
        self._group.kill(watched.spec)
        watched.exited_at = now
        self._wait(watched, now)

    def _wait(self, watched: _Watched, due: float) -> None:
        """Restart it at ``due``, or as soon after as its GPU, processes and ports allow."""
        watched.state = "waiting"
        watched.due = due
        watched.next_complaint = due + 5.0  # a moment's wait for ports is normal: not worth a line

    def _gpu_blocker(self, watched: _Watched) -> str | None:
        """Another instance starting on one of its GPUs: they start one at a time."""
        for other in self._watched:
            if other is not watched and other.state == "starting" and other.spec.gpus & watched.spec.gpus:
                gpus = ", ".join(sorted(other.spec.gpus & watched.spec.gpus))
                return f"{other.spec.name} is starting on GPU {gpus}, and instances sharing a GPU start one at a time"
        return None

    def _respawn(self, watched: _Watched, now: float) -> None:
        blocker = self._gpu_blocker(watched) or self._group.respawn_blocker(watched.spec)
        if blocker is not None:  # its GPU is busy, or its old processes or ports linger: try again next tick
            if now >= watched.next_complaint:
                watched.next_complaint = now + _BLOCKED_SAY_EVERY_S
                self._say(f"{watched.spec.name} cannot restart yet: {blocker}")
            self._group.kill(watched.spec)
            return
        try:
            self._group.respawn(watched.spec)
        except EngineStartError as exc:
            if not self._stopping.is_set():
                self._failed(watched, now, str(exc))
            return
        watched.state = "starting"
        watched.due = now + self._group.startup_timeout
        num = len(watched.exits)
        self._emit(watched, "restarting", f"restart {num} of at most {self.policy.max_restarts} "
                                          f"within {self.policy.window_s:.0f} s")  # fmt: skip

    def _emit(self, watched: _Watched, kind: InstanceEventKind, detail: str) -> None:
        try:
            self._on_event(InstanceEvent(watched.spec.url, kind, detail))
        except Exception:
            log.exception("delivering %s for %s failed", kind, watched.spec.name)


def _stranded_watch(spec: InstanceSpec) -> StrandedWatch | None:
    timeout_s = push_registration_timeout(spec)
    return StrandedWatch(timeout_s) if timeout_s is not None else None
