"""Instances on a Ray cluster: one Ray actor per planned instance, the instance a process of that actor.

The actor (``InstanceActor``) lands on a node that has the resources its role names (engines/rayplacement.py),
learns the node's IP, and runs the instance there with the launcher (a one-instance ``EngineGroup``:
same process group, log and health wait as on one host), bound to and advertised at that IP. When the
instance exits the actor exits too, and Ray restarts it (``max_restarts``): the new actor starts the
instance again, on the same node if it is still there. ``RayEngineGroup`` is the driver's side: connect,
check the cluster can place every instance, create the actors stage by stage, learn the URLs, stop.
``RayWatch`` tells the proxy when an instance goes and comes back. ``RayEngines`` is the two as the
``EngineBackend`` stack.py runs (engines/backend.py).

The one module that imports ray (an optional extra; import-linter enforces it). Ray's errors become
pdserve's here. Paths (engine python, model, run dir) must be the same on every node: a shared
filesystem, or identical images.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import ray.exceptions

from pdserve import httpclient
from pdserve.engines.backend import OnEvent
from pdserve.engines.launcher import EngineGroup
from pdserve.engines.placement import InstanceSpec
from pdserve.engines.rayplacement import (
    ActorState,
    NodeInstance,
    actor_name,
    actor_options,
    at_node,
    next_event,
    unplaceable,
)
from pdserve.engines.stranded import InFlight
from pdserve.errors import ConfigError, EngineError, EngineStartError
from pdserve.events import InstanceEvent, InstanceEventKind
from pdserve.topology import Topology

MAX_RESTARTS = 5  # Ray restarts a crash-looping instance this often, then the proxy is told it gave up
_EXIT_POLL_S = 0.5
_WATCH_INTERVAL_S = 1.0
_CALL_TIMEOUT_S = 5.0
_JOIN_GRACE_S = 15.0


class InstanceActor:
    """Runs on the node Ray chose: one instance, started in the constructor and watched for its exit.

    Ray runs a restarted actor's constructor again, which is how a crashed instance comes back; the
    log is appended to, so the crash stays readable.
    """

    def __init__(
        self, spec: InstanceSpec, engine_python: str, entrypoint: Sequence[str], run_dir: str, timeout: float
    ) -> None:
        node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._spec = at_node(spec, node_ip)
        self._group = EngineGroup((self._spec,), engine_python, Path(run_dir), timeout, entrypoint=entrypoint)
        self._is_stopping = False
        if self._group.log_path(self._spec).exists():  # a restart: wait for the old one's ports
            self._group.restart(self._spec)
        else:
            self._group.start()
        threading.Thread(target=self._exit_with_instance, name="pdserve-instance", daemon=True).start()

    def describe(self) -> NodeInstance:
        pid = self._group.pid(self._spec)
        return NodeInstance(
            self._spec.name,
            self._spec.host,
            self._spec.url,
            pid or 0,
            str(self._group.log_path(self._spec)),
        )

    def stop(self) -> None:
        self._is_stopping = True
        self._group.stop()

    def _exit_with_instance(self) -> None:
        while not self._group.exited():
            time.sleep(_EXIT_POLL_S)
        if self._is_stopping:
            return
        status = self._group.exit_status(self._spec)
        self._group.kill(self._spec)  # what is left of its process group, e.g. an engine core
        with open(self._group.log_path(self._spec), "a") as log:
            log.write(f"# pdserve: {self._spec.name} {status}; its Ray actor exits so Ray restarts it\n")
        os._exit(1)  # an actor that dies (not one that returns) is what Ray restarts


_REMOTE_ACTOR: Any = ray.remote(InstanceActor)


class RayEngineGroup:
    """The instances of a topology as Ray actors; the driver's side. ``start`` returns when every
    instance is healthy, with ``specs`` at their nodes' IPs; ``stop`` stops them and disconnects."""

    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        topology: Topology,
        engine_python: str,
        run_dir: str | Path,
        entrypoint: Sequence[str],
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        if topology.ray is None:
            raise ConfigError("RayEngineGroup needs topology.ray (the cluster's address)")
        self._planned = tuple(specs)
        self._topology = topology
        self._engine_python = engine_python
        self._run_dir = str(Path(run_dir).resolve())  # the nodes read it: no relative path
        self._entrypoint = tuple(entrypoint)
        self._on_progress = on_progress or (lambda _message: None)
        self._run_id = uuid.uuid4().hex[:8]
        self._actors: dict[str, Any] = {}
        self._nodes: dict[str, NodeInstance] = {}

    @property
    def specs(self) -> tuple[InstanceSpec, ...]:
        """The instances at the nodes they run on (as planned until ``start`` placed them)."""
        return tuple(
            at_node(s, self._nodes[s.name].node_ip) if s.name in self._nodes else s for s in self._planned
        )

    def node(self, spec: InstanceSpec) -> NodeInstance | None:
        return self._nodes.get(spec.name)

    def log_path(self, spec: InstanceSpec) -> Path:
        return Path(self._run_dir) / f"{spec.name}.log"

    def start(self) -> None:
        """Connect, check placement, create the actors stage by stage; EngineStartError (after stopping
        what started) if an instance fails, ConfigError if the cluster cannot place one."""
        try:
            self._connect()
            self._check_placement()
            for stage in sorted({s.start_stage for s in self._planned}):
                batch = [s for s in self._planned if s.start_stage == stage]
                started = time.monotonic()
                for spec in batch:
                    self._actors[spec.name] = self._create(spec)
                for spec in batch:
                    node = self._describe(spec, self._topology.startup_timeout + 60)
                    self._nodes[spec.name] = node
                    self._on_progress(
                        f"{spec.name} up on Ray node {node.node_ip} after {time.monotonic() - started:.0f} s"
                    )
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every instance (SIGTERM, then SIGKILL), end its actor for good, disconnect; idempotent."""
        actors, self._actors = self._actors, {}
        if actors:
            self._on_progress(f"stopping {len(actors)} instance(s) through their Ray actors")
        pending = []
        for actor in actors.values():
            try:
                pending.append(actor.stop.remote())
            except ray.exceptions.RayError:
                continue
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout)
        for actor in actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except ray.exceptions.RayError:
                continue
        if ray.is_initialized():
            ray.shutdown()

    def poll(self, spec: InstanceSpec) -> NodeInstance | ActorState:
        """What the instance's actor says now, or why it says nothing: Ray is restarting it, the call
        timed out (a busy node: the actor may be fine), or Ray has given up on it (restarts spent, stopped)."""
        actor = self._actors.get(spec.name)
        if actor is None:
            return "gone"
        try:
            node: NodeInstance = ray.get(actor.describe.remote(), timeout=_CALL_TIMEOUT_S)
        except ray.exceptions.ActorDiedError:
            return "gone"
        except (ray.exceptions.GetTimeoutError, TimeoutError):
            return "unresponsive"
        except ray.exceptions.RayError:
            return "restarting"
        return node

    def _connect(self) -> None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the cluster
        try:
            ray.init(
                address=self._topology.ray,
                namespace="pdserve",
                log_to_driver=False,  # each instance has its log file; Ray would interleave them here
                logging_level=logging.WARNING,
            )
        except (ConnectionError, ray.exceptions.RayError, RuntimeError, ValueError) as exc:
            raise EngineStartError(
                f"cannot connect to the Ray cluster at {self._topology.ray}: {exc}"
            ) from exc

    def _check_placement(self) -> None:
        wanted = [(s.name, actor_options(s, self._topology)) for s in self._planned]
        # Nodes started a moment ago may not have joined yet (`ray start` returns before the head lists them).
        deadline = time.monotonic() + _JOIN_GRACE_S
        while True:
            listed: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
            problems = unplaceable(wanted, [dict(n["Resources"]) for n in listed if n.get("Alive")])
            if not problems:
                return
            if time.monotonic() > deadline:
                raise ConfigError("the Ray cluster cannot place every instance:\n  " + "\n  ".join(problems))
            time.sleep(0.5)

    def _create(self, spec: InstanceSpec) -> Any:
        restarts = MAX_RESTARTS if self._topology.on_instance_exit == "restart" else 0
        return _REMOTE_ACTOR.options(
            name=actor_name(self._run_id, spec), max_restarts=restarts, **actor_options(spec, self._topology)
        ).remote(spec, self._engine_python, self._entrypoint, self._run_dir, self._topology.startup_timeout)

    def _describe(self, spec: InstanceSpec, timeout: float) -> NodeInstance:
        try:
            node: NodeInstance = ray.get(self._actors[spec.name].describe.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise EngineStartError(f"{spec.name}: its Ray actor did not start in {timeout:.0f} s") from exc
        except ray.exceptions.RayError as exc:
            raise EngineStartError(f"{spec.name} did not start on Ray: {exc}") from exc
        return node


class RayWatch:
    """Follows each instance's actor on a thread: tells the proxy (``on_event``) when one is gone
    (``exited``), back and healthy (``ready``), or not coming back (``gave_up``)."""

    def __init__(self, group: RayEngineGroup, on_event: Callable[[InstanceEvent], None]) -> None:
        self._group = group
        self._on_event = on_event
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-ray-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_CALL_TIMEOUT_S * 2)

    def _run(self) -> None:
        specs = self._group.specs
        known = {s.name: self._group.node(s) for s in specs}
        urls = {s.name: s.url for s in specs}  # where the proxy knows each: a move changes it
        told: dict[str, InstanceEventKind] = {}  # what the proxy last heard of an instance, if anything
        while not self._stop.wait(_WATCH_INTERVAL_S):
            for spec in specs:
                if told.get(spec.name) == "gave_up":
                    continue
                now = self._group.poll(spec)
                if self._stop.is_set():
                    return
                url = urls[spec.name]
                event = next_event(spec, url, known[spec.name], now, told.get(spec.name), _is_healthy)
                if isinstance(now, NodeInstance):
                    known[spec.name] = now
                if event is not None:
                    told[spec.name] = event.kind
                    if event.kind == "moved":
                        urls[spec.name] = event.new_url
                    self._on_event(event)


class RayEngines:
    """The instances of a topology as Ray actors (``RayEngineGroup``), watched by ``RayWatch``: Ray
    restarts an instance that exits (no Supervisor), up to ``MAX_RESTARTS`` with on_instance_exit
    restart, never with stop. Logs are on the nodes, at the same run dir path."""

    def __init__(self, group: RayEngineGroup, topology: Topology) -> None:
        self.group = group
        self._topology = topology
        self._watch: RayWatch | None = None

    @property
    def specs(self) -> tuple[InstanceSpec, ...]:
        return self.group.specs

    def start(self) -> None:
        self.group.start()

    def watch(self, on_event: OnEvent, in_flight: InFlight | None = None) -> None:
        # in_flight serves the push decodes' stranded-block restart, which local supervision does alone
        self._watch = RayWatch(self.group, on_event)
        self._watch.start()

    def stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        self.group.stop()

    def check_alive(self) -> None:
        if self._topology.on_instance_exit == "stop":
            gone = [s.name for s in self.group.specs if self.group.poll(s) == "gone"]
            if gone:
                raise EngineError(f"{', '.join(gone)} exited on Ray (on_instance_exit: stop)")

    def log_place(self, spec: InstanceSpec) -> str:
        return f"on the Ray node, {self.group.log_path(spec)}"


def _is_healthy(url: str) -> bool:
    return httpclient.is_ok(f"{url}/health", timeout=2.0)
