"""Process groups as the launcher sees them, from signals and /proc: how a child is started (``spawn``:
its own session, and the parent-death signal), is any member still running, what runs in it, every
process's parent.

Linux-first: /proc is read directly, and zombies count as gone since they hold no port or memory; elsewhere
a group is alive as long as ``killpg(pgid, 0)`` finds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1


def group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Whether any process of the group led by ``proc`` still runs (reaping the leader if it exited)."""
    proc.poll()  # never blocks: from a signal handler it may only skip the reaping
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg also finds zombies: orphaned engine-core processes wait for init to reap them, and some
    # container inits never do. A zombie holds no port or memory, so on Linux look past them.
    return not sys.platform.startswith("linux") or bool(running_members(proc.pid))


def running_members(pgid: int) -> list[str]:
    """``pid (comm, state)`` of each process of group ``pgid`` that is not a zombie."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        state, _ppid, pgrp = stat[stat.rindex(b")") + 2 :].split(b" ", 3)[:3]
        if int(pgrp) == pgid and state not in (b"Z", b"X"):
            comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
            members.append(f"{entry} ({comm}, {state.decode()})")
    return members


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, sig)


def process_table() -> dict[int, tuple[str, int]]:
    """Every process's (comm, parent pid), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        found[int(entry.name)] = (comm, int(stat[stat.rindex(")") + 2 :].split()[1]))
    return found


def spawn(
    argv: Sequence[str],
    *,
    stdin: int | IO[bytes] | None = subprocess.DEVNULL,
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a session of its own (its process group is what stopping signals,
    and Ctrl-C on pdserve's terminal is pdserve's to handle) that gets SIGTERM when the calling thread
    dies (Linux): a pdserve killed with SIGKILL leaves no child holding ports and memory. So the thread
    that calls this must live as long as the child. OSError when ``argv`` cannot be run."""
    return subprocess.Popen(
        argv,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent(os.getpid()) if sys.platform == "linux" else None,
    )


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that has the child get SIGTERM when the thread that spawned it dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child must not import or allocate
    sigterm = int(signal.SIGTERM)

    def set_pdeathsig() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_pdeathsig
