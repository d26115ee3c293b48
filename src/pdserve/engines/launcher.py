"""Start, watch and stop a group of vLLM instances.

Each instance runs in its own session, so its process group holds the API server and the engine-core
processes vLLM forks from it; stopping signals the whole group (processes.py). On Linux each instance
also gets PR_SET_PDEATHSIG=SIGTERM, so a parent killed with SIGKILL leaves no orphan holding ports and
memory. Every module that runs a process lives in engines/: this one, model.py (building the tiny
model), venv.py (asking the engine python its vLLM version) and benchclient.py (vLLM's bench client).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from pdserve import httpclient
from pdserve.engines.placement import NIXL_PROGRESS_DELAY_ENV, InstanceSpec
from pdserve.engines.processes import (
    group_alive,
    process_table,
    running_members,
    signal_group,
    spawn,
)
from pdserve.errors import ConfigError, EngineError, EngineStartError

DEFAULT_ENTRYPOINT: tuple[str, ...] = ("-m", "vllm.entrypoints.openai.api_server")
_POLL_INTERVAL = 0.25  # seconds between health rounds while starting, and between checks while stopping
_HEARTBEAT_INTERVAL = 10.0
_LOG_TAIL_LINES = 30
RUN_HEADER = "# pdserve:"  # the first line each (re)start writes into the instance's log: the command
_ENGINE_CORE_LOG_PID = re.compile(r"\(EngineCore(?:_DP\d+)? pid=(\d+)\)")
_ENGINESITE = Path(__file__).parent / "enginesite"  # a sitecustomize for vLLM's processes, not a package


class EngineGroup:
    """The instances of one topology. Use as a context manager, or call ``start`` and then ``stop``.

    Call ``start`` from a thread that lives as long as the group: PR_SET_PDEATHSIG fires when the
    *thread* that spawned a child exits, not only the process.
    """

    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        engine_python: str,
        run_dir: Path,
        startup_timeout: float = 600.0,
        on_progress: Callable[[str], None] | None = None,
        entrypoint: Sequence[str] = DEFAULT_ENTRYPOINT,
    ) -> None:
        self._specs = tuple(specs)
        self._engine_python = engine_python
        self._run_dir = Path(run_dir)
        self._startup_timeout = startup_timeout
        self._on_progress = on_progress or (lambda _message: None)
        self._entrypoint = tuple(entrypoint)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._is_stopping = False

    @property
    def specs(self) -> tuple[InstanceSpec, ...]:
        return self._specs

    def log_path(self, spec: InstanceSpec) -> Path:
        return self._run_dir / f"{spec.name}.log"

    @property
    def startup_timeout(self) -> float:
        return self._startup_timeout

    def pid(self, spec: InstanceSpec) -> int | None:
        """PID (and process-group id) of the instance's API server, None if it was never spawned."""
        proc = self._procs.get(spec.name)
        return proc.pid if proc else None

    def engine_core_pid(self, spec: InstanceSpec) -> int | None:
        """PID of the instance's vLLM EngineCore (the API server's child that schedules and steps the
        model: what a stall test stops with SIGSTOP), None if there is none (a simulator, not started).

        Found by its process title (``VLLM::EngineCore``), or, where vLLM could not set one (no
        setproctitle, as on a GPU host set up with scripts/offline-bundle.sh), by the pid its log lines carry."""
        api_pid = self.pid(spec)
        if api_pid is None:
            return None
        children = {pid: comm for pid, (comm, ppid) in process_table().items() if ppid == api_pid}
        for pid, comm in children.items():
            if comm.startswith("VLLM::EngineCor"):
                return pid
        try:
            log_text = self.log_path(spec).read_text(errors="replace")
        except OSError:
            return None
        logged = [int(m) for m in _ENGINE_CORE_LOG_PID.findall(log_text)]
        return next((pid for pid in reversed(logged) if pid in children), None)

    def start(self) -> None:
        """Spawn the instances stage by stage (``InstanceSpec.start_stage``) and return when all answer
        GET /health with 200. A stage's instances start together, the next stage once they are healthy;
        the startup timeout applies to each stage.

        Raises ConfigError if a port is taken, EngineStartError (after stopping every instance) if one
        exits or the startup timeout passes.
        """
        if self._procs:
            raise EngineError("an EngineGroup starts once; make a new one to start again")
        _check_ports_free(self._specs)
        self._run_dir.mkdir(parents=True, exist_ok=True)
        stages = sorted({spec.start_stage for spec in self._specs})
        try:
            for stage in stages:
                batch = [spec for spec in self._specs if spec.start_stage == stage]
                if len(stages) > 1:
                    self._on_progress(
                        f"starting {', '.join(s.name for s in batch)} (stage {stage + 1} of {len(stages)}: "
                        "instances sharing a GPU start one after the other)"
                    )
                started = time.monotonic()
                for spec in batch:
                    self._spawn(spec)
                self._wait_healthy(started, batch)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``timeout`` s; idempotent.

        Takes no locks and never blocks in waitpid, so a signal handler may call it mid-``start``.
        """
        self._is_stopping = True
        live = {name: proc for name, proc in self._procs.items() if group_alive(proc)}
        for proc in live.values():
            signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while live and time.monotonic() < deadline:
            time.sleep(_POLL_INTERVAL / 5)
            live = {name: proc for name, proc in live.items() if group_alive(proc)}
        for name, proc in live.items():
            self._on_progress(f"{name} still running {timeout:.0f} s after SIGTERM; sending SIGKILL")
            signal_group(proc.pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + 5.0  # SIGKILL cannot be ignored; this only waits for the reaping
        while live and time.monotonic() < kill_deadline:
            time.sleep(_POLL_INTERVAL / 5)
            live = {name: proc for name, proc in live.items() if group_alive(proc)}

    def check_alive(self) -> None:
        """Raise EngineError naming every instance whose process has exited (no-op once stopping)."""
        if self._is_stopping:
            return
        dead = self.exited()
        if dead:
            raise EngineError("\n\n".join(self._describe_exit(spec) for spec in dead))

    def exited(self) -> tuple[InstanceSpec, ...]:
        """The instances whose API server has exited (none once stopping); raises nothing."""
        if self._is_stopping:
            return ()
        return tuple(s for s in self._specs if s.name in self._procs and _has_exited(self._procs[s.name]))

    def exit_status(self, spec: InstanceSpec) -> str:
        """How the instance's API server ended, e.g. ``was killed by SIGKILL``."""
        proc = self._procs.get(spec.name)
        code = proc.poll() if proc else None
        if code is None:
            return "is running" if proc else "was never started"
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"

    def kill(self, spec: InstanceSpec) -> None:
        """SIGKILL whatever is left of the instance's process group; returns at once."""
        proc = self._procs.get(spec.name)
        if proc is not None and group_alive(proc):
            signal_group(proc.pid, signal.SIGKILL)

    def can_respawn(self, spec: InstanceSpec) -> bool:
        """Whether ``respawn`` can start the instance now: its processes are gone and its ports free."""
        return self.respawn_blocker(spec) is None

    def respawn_blocker(self, spec: InstanceSpec) -> str | None:
        """Why ``respawn`` cannot start the instance yet, or None when it can."""
        if self._is_stopping:
            return "the instances are being stopped"
        proc = self._procs.get(spec.name)
        if proc is not None and group_alive(proc):
            members = ", ".join(running_members(proc.pid)) or "(not listed)"
            return f"processes of its old process group {proc.pid} still run: {members}"
        try:
            _check_ports_free([spec])
        except ConfigError as exc:
            return str(exc)
        return None

    def respawn(self, spec: InstanceSpec) -> None:
        """Start a stopped instance again, appending to its log; does not wait for it to be healthy.

        The thread that calls this must live as long as the instance (PR_SET_PDEATHSIG, see the class).
        """
        self._spawn(spec, mode="ab")

    def is_healthy(self, spec: InstanceSpec) -> bool:
        return _is_healthy(spec.url)

    def __enter__(self) -> EngineGroup:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(self, spec: InstanceSpec, mode: str = "wb") -> None:
        command = [*spec.command_prefix, self._engine_python, *self._entrypoint, *spec.args]
        with open(self.log_path(spec), mode) as log:
            log.write(f"{RUN_HEADER} {' '.join(command)}\n# env: {dict(spec.env)}\n".encode())
            log.flush()
            try:
                proc = self._procs[spec.name] = spawn(
                    command, stdout=log, stderr=subprocess.STDOUT, env=_instance_env(spec)
                )
            except OSError as exc:
                raise EngineStartError(f"{spec.name}: cannot run {self._engine_python}: {exc}") from exc
        # stop() may have taken its list of processes while this one was being spawned (from another
        # thread, or a signal handler): then nobody else would ever stop it.
        if self._is_stopping:
            signal_group(proc.pid, signal.SIGKILL)
            raise EngineStartError(f"{spec.name}: not started, the instances are being stopped")

    def restart(self, spec: InstanceSpec, timeout: float = 20.0) -> None:
        """Stop one instance (whatever state it is in) and start it again; returns once it is healthy.

        Its log is appended to, so what happened before the restart stays readable. ``stop()`` from
        another thread interrupts it with EngineStartError. Under a Supervisor, leave restarts to it.
        """
        deadline = time.monotonic() + timeout
        self.kill(spec)
        # A killed process can hold its listening sockets a moment longer than it shows as running.
        while not self.can_respawn(spec) and time.monotonic() < deadline:
            if self._is_stopping:
                raise EngineStartError(f"restart of {spec.name} interrupted: the instances were stopped")
            time.sleep(_POLL_INTERVAL / 5)
        _check_ports_free([spec])
        self.respawn(spec)
        self._wait_healthy(time.monotonic(), [spec])

    def _wait_healthy(self, started: float, specs: Sequence[InstanceSpec] | None = None) -> None:
        specs = self._specs if specs is None else tuple(specs)
        healthy: set[str] = set()
        next_heartbeat = started + _HEARTBEAT_INTERVAL
        while True:
            if self._is_stopping:  # stop() came from elsewhere, e.g. a signal handler
                raise EngineStartError("start-up interrupted: the instances were stopped")
            for spec in specs:
                if _has_exited(self._procs[spec.name]):
                    raise EngineStartError(self._describe_exit(spec, during_start=True))
                if spec.name not in healthy and _is_healthy(spec.url):
                    healthy.add(spec.name)
                    self._on_progress(
                        f"{spec.name} up after {time.monotonic() - started:.0f} s "
                        f"({len(healthy)}/{len(specs)} healthy)"
                    )
            if len(healthy) == len(specs):
                return
            now = time.monotonic()
            waiting = [spec for spec in specs if spec.name not in healthy]
            if now - started > self._startup_timeout:
                names = ", ".join(s.name for s in waiting)
                raise EngineStartError(
                    f"not healthy after {self._startup_timeout:.0f} s: {names}\n\n"
                    + "\n\n".join(f"last lines of {self.log_path(s)}:\n{self.log_tail(s)}" for s in waiting)
                )
            if now >= next_heartbeat:
                next_heartbeat = now + _HEARTBEAT_INTERVAL
                for spec in waiting:
                    last = self.log_tail(spec, 1) or "(no output yet)"
                    self._on_progress(f"{spec.name} still starting after {now - started:.0f} s: {last}")
            time.sleep(_POLL_INTERVAL)

    def _describe_exit(self, spec: InstanceSpec, during_start: bool = False) -> str:
        when = " while starting" if during_start else ""
        return (
            f"{spec.name} (pid {self._procs[spec.name].pid}) {self.exit_status(spec)}{when}; "
            f"last lines of {self.log_path(spec)}:\n{self.log_tail(spec)}"
        )

    def log_tail(self, spec: InstanceSpec, num_lines: int = _LOG_TAIL_LINES) -> str:
        """The last non-blank lines of the instance's log (all its runs: restarts append)."""
        try:
            with open(self.log_path(spec), "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 64 * 1024))
                text = log.read().decode(errors="replace")
        except OSError as exc:
            return f"(cannot read log: {exc})"
        lines = [line.rstrip() for line in text.splitlines() if line.strip()]
        return "\n".join(lines[-num_lines:])


def _check_ports_free(specs: Sequence[InstanceSpec]) -> None:
    owners: dict[tuple[str, int], str] = {}
    for spec in specs:
        for kind, port in (("HTTP", spec.port), ("NIXL side-channel", spec.side_channel_port)):
            if (spec.host, port) in owners:
                raise ConfigError(f"{spec.name} and {owners[spec.host, port]} both use port {port}")
            owners[spec.host, port] = spec.name
            if spec.command_prefix:  # it binds elsewhere (another namespace or host): not ours to probe
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                # Like the servers that will bind it: TIME_WAIT leftovers do not count, listeners do.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((spec.host, port))
                except OSError as exc:
                    raise ConfigError(
                        f"{kind} port {port} of {spec.name} on {spec.host} is not free ({exc.strerror}); "
                        "stop what holds it or choose other ports (first_port / first_side_channel_port)"
                    ) from exc


def _is_healthy(url: str) -> bool:
    return httpclient.is_ok(f"{url}/health", timeout=2.0)


def _has_exited(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is not None


def _instance_env(spec: InstanceSpec) -> dict[str, str]:
    """This process's environment plus the instance's own. An instance told to tune NIXL gets
    engines/enginesite first on its PYTHONPATH, where its ``sitecustomize`` does it (that file says why)."""
    env = {**os.environ, **dict(spec.env)}
    if NIXL_PROGRESS_DELAY_ENV in env:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ENGINESITE), env.get("PYTHONPATH")) if p)
    return env
