"""EngineGroup against a fake engine (tests/engines/fake_engine.py) instead of vLLM: fast and exact."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.config import Role
from pdserve.engines import launcher
from pdserve.engines.launcher import EngineGroup
from pdserve.engines.placement import InstanceSpec
from pdserve.errors import ConfigError, EngineError, EngineStartError

FAKE_ENGINE = str(Path(__file__).with_name("fake_engine.py"))
MakeGroup = Callable[..., EngineGroup]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def fake_spec(role: Role = "prefill", index: int = 0, *extra: str) -> InstanceSpec:
    port = free_port()
    args = ("--host", "127.0.0.1", "--port", str(port), *extra)
    return InstanceSpec(role, index, "127.0.0.1", port, free_port(), args, ())


def group_is_running(pgid: int) -> bool:
    """Any non-zombie process left in the group (this machine's init does not reap orphans)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
            except OSError:
                continue
            state, _ppid, pgrp = stat[stat.rindex(b")") + 2 :].split(b" ", 3)[:3]
            if int(pgrp) == pgid and state not in (b"Z", b"X"):
                return True
    return False


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def health_status(spec: InstanceSpec) -> int:
    with urllib.request.urlopen(f"{spec.url}/health", timeout=2) as response:
        return int(response.status)


@pytest.fixture
def messages() -> list[str]:
    return []


@pytest.fixture
def make_group(tmp_path: Path, messages: list[str]) -> Iterator[MakeGroup]:
    groups: list[EngineGroup] = []

    def make(*specs: InstanceSpec, startup_timeout: float = 10.0) -> EngineGroup:
        group = EngineGroup(
            specs, sys.executable, tmp_path, startup_timeout, messages.append, entrypoint=(FAKE_ENGINE,)
        )
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.stop(timeout=2.0)


def test_start_returns_once_every_instance_is_healthy(
    make_group: MakeGroup, messages: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "_HEARTBEAT_INTERVAL", 0.3)
    fast = fake_spec("prefill", 0, "--delay", "0.2")
    slow = fake_spec("decode", 0, "--delay", "1.2")
    group = make_group(fast, slow)
    began = time.monotonic()
    group.start()
    assert time.monotonic() - began >= 1.2
    assert health_status(fast) == health_status(slow) == 200
    assert any(m.startswith("decode-0 up after") and "(2/2 healthy)" in m for m in messages)
    # The heartbeat names what is still starting and shows its last log line.
    assert any("decode-0 still starting" in m and "fake engine loading model" in m for m in messages)
    assert group.log_path(slow).read_text().count("fake engine serving") == 1


def test_crashing_instance_fails_start_with_its_log_tail_and_stops_the_rest(make_group: MakeGroup) -> None:
    healthy_never = fake_spec("prefill", 0, "--delay", "60", "--child")
    crashing = fake_spec("decode", 0, "--crash-after", "0.3")
    group = make_group(healthy_never, crashing)
    began = time.monotonic()
    with pytest.raises(EngineStartError) as caught:
        group.start()
    assert time.monotonic() - began < 5
    message = str(caught.value)
    assert "decode-0" in message and "exited with code 3 while starting" in message
    assert "RuntimeError: fake engine failed to allocate KV cache" in message
    survivor_pid = group.pid(healthy_never)
    assert survivor_pid is not None and not group_is_running(survivor_pid)


def test_stop_leaves_no_process_and_frees_the_port(make_group: MakeGroup) -> None:
    spec = fake_spec("prefill", 0, "--child")
    group = make_group(spec)
    group.start()
    pgid = group.pid(spec)
    assert pgid is not None and group_is_running(pgid)
    began = time.monotonic()
    group.stop()
    assert time.monotonic() - began < 3  # went down on SIGTERM, no SIGKILL needed
    assert not group_is_running(pgid)  # the "engine-core" child too, not only the API server
    assert port_is_free(spec.port)
    group.stop()  # idempotent


def test_the_engine_core_a_stall_test_stops_is_found_by_its_log_line_where_it_has_no_title(
    make_group: MakeGroup,
) -> None:
    # vLLM where setproctitle is not installed (the CUDA image of the H200 runs had none): its EngineCore
    # is a plain "python3" child.
    spec = fake_spec("decode", 0, "--child")
    group = make_group(spec)
    group.start()
    core = group.engine_core_pid(spec)
    assert core is not None and core != group.pid(spec)
    assert f"(EngineCore pid={core})" in group.log_path(spec).read_text()
    assert group.engine_core_pid(fake_spec("prefill", 1)) is None  # never started


def test_instance_ignoring_sigterm_is_killed_within_the_timeout(
    make_group: MakeGroup, messages: list[str]
) -> None:
    spec = fake_spec("decode", 0, "--ignore-sigterm", "--child")
    group = make_group(spec)
    group.start()
    pgid = group.pid(spec)
    assert pgid is not None
    began = time.monotonic()
    group.stop(timeout=1.0)
    assert 1.0 <= time.monotonic() - began < 3.0
    assert not group_is_running(pgid)
    assert any("decode-0" in m and "SIGKILL" in m for m in messages)


def test_busy_port_is_a_config_error_naming_port_and_instance(make_group: MakeGroup) -> None:
    spec = fake_spec("decode", 1)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", spec.side_channel_port))
        squatter.listen()
        group = make_group(fake_spec("prefill", 0), spec)
        with pytest.raises(ConfigError, match=f"port {spec.side_channel_port} of decode-1"):
            group.start()
    assert all(group.pid(s) is None for s in group.specs)  # nothing was spawned


def test_command_prefix_runs_the_instance_through_it_and_stop_still_ends_it(make_group: MakeGroup) -> None:
    # A prefix such as `ip netns exec NS` puts the instance's ports in another namespace: a local
    # listener on the same number is no conflict there, so it must not stop the start.
    spec = dataclasses.replace(fake_spec("prefill", 0, "--child"), command_prefix=("env", "PDSERVE_VIA=1"))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", spec.side_channel_port))
        squatter.listen()
        group = make_group(spec)
        group.start()
    assert health_status(spec) == 200
    assert group.log_path(spec).read_text().startswith(f"# pdserve: env PDSERVE_VIA=1 {sys.executable} ")
    pgid = group.pid(spec)
    assert pgid is not None and group_is_running(pgid)
    group.stop()
    assert not group_is_running(pgid)  # the prefix exec'd the engine: its process group is the engine's


def test_startup_timeout_stops_everything_and_names_the_slow_instance(make_group: MakeGroup) -> None:
    spec = fake_spec("prefill", 0, "--delay", "60")
    # Long enough for the fake to print its first line even on a loaded CI machine.
    group = make_group(spec, startup_timeout=4.0)
    with pytest.raises(EngineStartError, match="not healthy after 4 s: prefill-0") as caught:
        group.start()
    assert "fake engine loading model" in str(caught.value)
    pgid = group.pid(spec)
    assert pgid is not None and not group_is_running(pgid)


def test_check_alive_names_an_instance_that_died_after_start(make_group: MakeGroup) -> None:
    prefill, decode = fake_spec("prefill", 0), fake_spec("decode", 0)
    group = make_group(prefill, decode)
    group.start()
    group.check_alive()
    pid = group.pid(decode)
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while True:  # the kill takes a moment to be seen
        try:
            group.check_alive()
        except EngineError as exc:
            assert re.search(r"decode-0 \(pid \d+\) was killed by SIGKILL", str(exc))
            assert "prefill-0" not in str(exc)
            break
        assert time.monotonic() < deadline, "check_alive never noticed the dead instance"
        time.sleep(0.05)
    group.stop()
    group.check_alive()  # exits after stop() are expected, not errors


def test_restart_brings_back_a_killed_instance_on_its_port_and_keeps_its_log(make_group: MakeGroup) -> None:
    prefill, decode = fake_spec("prefill", 0), fake_spec("decode", 0)
    group = make_group(prefill, decode)
    group.start()
    old_pid = group.pid(decode)
    assert old_pid is not None
    os.killpg(old_pid, signal.SIGKILL)
    group.restart(decode)
    new_pid = group.pid(decode)
    assert new_pid is not None and new_pid != old_pid
    with urllib.request.urlopen(f"{decode.url}/health", timeout=2) as resp:
        assert resp.status == 200
    group.check_alive()  # the replacement counts as alive; the old exit is forgotten
    assert group.log_path(decode).read_text().count("# pdserve:") == 2
    group.stop()


def test_missing_engine_python_is_a_start_error(tmp_path: Path) -> None:
    group = EngineGroup([fake_spec()], str(tmp_path / "no-python"), tmp_path, entrypoint=(FAKE_ENGINE,))
    with pytest.raises(EngineStartError, match="prefill-0: cannot run"):
        group.start()


def test_instances_die_when_the_launching_process_is_sigkilled(tmp_path: Path) -> None:
    spec = fake_spec("prefill", 0, "--child")
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from pdserve.engines.launcher import EngineGroup
        from pdserve.engines.placement import InstanceSpec
        spec = InstanceSpec("prefill", 0, "127.0.0.1", {spec.port}, {spec.side_channel_port}, {spec.args!r}, ())
        group = EngineGroup([spec], sys.executable, Path({str(tmp_path)!r}), entrypoint=({FAKE_ENGINE!r},))
        group.start()
        print(group.pid(spec), flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pgid = None
    try:
        assert parent.stdout is not None
        pgid = int(parent.stdout.readline())
        assert group_is_running(pgid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _leader_running(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # PDEATHSIG covers the API server only; the fake engine's child does not watch its parent
        # (vLLM's engine core does), so only the leader is asserted on.
        assert not _leader_running(pgid)
    finally:
        parent.kill()
        parent.wait()
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def _leader_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")


def test_exited_lists_dead_instances_without_raising(make_group: MakeGroup) -> None:
    prefill, decode = fake_spec("prefill", 0), fake_spec("decode", 0)
    group = make_group(prefill, decode)
    group.start()
    assert group.exited() == ()
    pid = group.pid(prefill)
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not group.exited() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group.exited() == (prefill,)
    assert group.exit_status(prefill) == "was killed by SIGKILL"
    group.stop()
    assert group.exited() == ()  # exits after stop() are expected


def test_stop_interrupts_a_restart_waiting_for_health(make_group: MakeGroup, tmp_path: Path) -> None:
    slow = tmp_path / "slow"
    spec = fake_spec("decode", 0, "--slow-if-exists", str(slow))
    group = make_group(spec, startup_timeout=120.0)
    group.start()
    slow.touch()
    outcome: list[BaseException] = []

    def restart() -> None:
        try:
            group.restart(spec)
        except EngineStartError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=restart)
    thread.start()
    time.sleep(1.0)
    began = time.monotonic()
    group.stop(timeout=2.0)
    thread.join(timeout=5)
    assert not thread.is_alive() and time.monotonic() - began < 3
    assert outcome and "interrupted" in str(outcome[0])
    pid = group.pid(spec)
    assert pid is not None and not group_is_running(pid)


def test_instances_sharing_a_gpu_start_one_after_the_other(
    make_group: MakeGroup, messages: list[str]
) -> None:
    first = dataclasses.replace(fake_spec("prefill", 0, "--delay", "0.8"), start_stage=0)
    second = dataclasses.replace(fake_spec("decode", 0, "--delay", "0.2"), start_stage=1)
    group = make_group(second, first)  # the stage decides the order, not the list
    began = time.monotonic()
    group.start()
    assert time.monotonic() - began >= 1.0  # 0.8 s, then 0.2 s: one after the other
    assert health_status(first) == health_status(second) == 200
    order = [m for m in messages if m.startswith(("starting", "prefill-0 up", "decode-0 up"))]
    assert [m.split(" after")[0].split(" (")[0] for m in order] == [
        "starting prefill-0",
        "prefill-0 up",
        "starting decode-0",
        "decode-0 up",
    ]


def test_a_first_stage_that_crashes_never_starts_the_next(make_group: MakeGroup) -> None:
    crashing = dataclasses.replace(fake_spec("prefill", 0, "--crash-after", "0.2"), start_stage=0)
    waiting = dataclasses.replace(fake_spec("decode", 0), start_stage=1)
    group = make_group(crashing, waiting)
    with pytest.raises(EngineStartError, match=r"prefill-0 .* exited with code 3 while starting"):
        group.start()
    assert group.pid(waiting) is None  # its GPU was never asked for memory
