"""Where a topology's instances run, behind one interface: ``EngineBackend``.

``Stack`` (stack.py) starts a backend, puts the proxy in front of its instances, then asks it to
``watch`` them: from then on the backend tells the proxy, through one callback, when an instance goes
and comes back and what its logs say of KV leases. Two backends exist: ``LocalEngines`` (processes on
this host, here) and ``RayEngines`` (Ray actors on a cluster, engines/ray_cluster.py).

    start()   every instance healthy, or EngineStartError after stopping what started
    watch(on_event, in_flight)   supervision and log following begin; events go to on_event, and
              in_flight tells how many requests the proxy has in flight at an instance
    stop()    watching first (nothing restarts an instance being stopped), then every instance
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.engines.launcher import EngineGroup
from pdserve.engines.logwatch import LogWatcher
from pdserve.engines.placement import InstanceSpec
from pdserve.engines.stranded import InFlight
from pdserve.engines.supervisor import RestartPolicy, Supervisor
from pdserve.events import InstanceEvent, KVLogEvent
from pdserve.topology import OnInstanceExit

OnEvent = Callable[[InstanceEvent | KVLogEvent], None]


class EngineBackend(Protocol):
    """The instances of one topology, wherever they run."""

    @property
    def specs(self) -> tuple[InstanceSpec, ...]:
        """The instances where they serve (their URLs are final once ``start`` returned)."""
        ...

    def start(self) -> None: ...

    def watch(self, on_event: OnEvent, in_flight: InFlight | None = None) -> None: ...

    def stop(self) -> None: ...

    def check_alive(self) -> None:
        """EngineError when an instance is gone for good and nothing brings it back."""
        ...

    def log_place(self, spec: InstanceSpec) -> str:
        """Where ``spec``'s log is, in words for the operator."""
        ...


class LocalEngines:
    """Instances as processes of this host (engines/launcher.py). With ``on_exit == "restart"`` a
    Supervisor restarts one that exits; a LogWatcher follows prefill logs for lease evidence either way."""

    def __init__(
        self,
        group: EngineGroup,
        on_exit: OnInstanceExit,
        say: Callable[[str], None] = print,
        restart_policy: RestartPolicy | None = None,
    ) -> None:
        self.group = group
        self._on_exit = on_exit
        self._say = say
        self._restart_policy = restart_policy
        self._watchers: list[Supervisor | LogWatcher] = []  # stopped in this order

    @property
    def specs(self) -> tuple[InstanceSpec, ...]:
        return self.group.specs

    def start(self) -> None:
        self.group.start()

    def watch(self, on_event: OnEvent, in_flight: InFlight | None = None) -> None:
        if self._on_exit == "restart":
            supervisor = Supervisor(self.group, on_event, self._say, self._restart_policy, in_flight)
            supervisor.start()
            self._watchers.append(supervisor)
        # The simulator's logs are followed too: they cost nothing when they never hold the lines.
        # An elastic instance holds KV for the others whenever it prefills: its log tells as prefill's does.
        prefill_logs = {s.url: self.group.log_path(s) for s in self.specs if s.role != "decode"}
        log_watcher = LogWatcher(prefill_logs, on_event)
        log_watcher.start()
        self._watchers.append(log_watcher)

    def stop(self) -> None:
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher.stop()
        self.group.stop()

    def check_alive(self) -> None:
        if self._on_exit == "stop":  # otherwise the supervisor brings them back
            self.group.check_alive()

    def log_place(self, spec: InstanceSpec) -> str:
        return str(self.group.log_path(spec))
