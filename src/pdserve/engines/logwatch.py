"""Follow prefill instances' logs for what vLLM says about KV leases, and report it as ``KVLogEvent``.

vLLM exports no per-request expiry (docs/vllm-kv-lifecycle.md, section 6): the only place that names the
handoff whose lease ran out unpulled, or whose released blocks a decode read anyway, is prefill's log.
The launcher writes each instance's output to one file and appends to it on restart, so a watcher
follows one growing file per instance; reading what is new every 0.1 s costs one read() per file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

from pdserve.events import EXPIRED_LINE, LATE_PULL_LINE, KVLogEvent, KVLogEventKind

log = logging.getLogger(__name__)

# "... which were retrieved by <n> remote worker(s) before lease expired." (nixl/base_worker.py): only
# n == 0 means nobody read the blocks. With n > 0 the lease ran out after the pull, which is harmless.
_UNPULLED = "which were retrieved by 0 remote worker(s)"
_MARKERS = (EXPIRED_LINE.encode(), LATE_PULL_LINE.encode())
_READ_CHUNK = 1 << 16
_MAX_READ_PER_POLL = 1 << 22  # a log flooding faster than this is caught up on over several polls
_MAX_PARTIAL = 1 << 16  # a line longer than this is not one of vLLM's lease lines: dropped


def parse_line(line: str) -> tuple[KVLogEventKind, str] | None:
    """``(kind, remote_request_id)`` for one of vLLM's lease lines, else None."""
    at = line.find(EXPIRED_LINE)
    if at >= 0:
        request_id, _, rest = line[at + len(EXPIRED_LINE) :].partition(" ")
        return ("expired", request_id) if request_id and rest.startswith(_UNPULLED) else None
    at = line.find(LATE_PULL_LINE)
    if at >= 0:
        request_id = line[at + len(LATE_PULL_LINE) :].partition(" ")[0]
        return ("late_pull", request_id) if request_id else None
    return None


class _Follower:
    """One log file, read from its start and then as it grows (from the start again if truncated)."""

    def __init__(self, url: str, path: Path) -> None:
        self.url = url
        self.path = path
        self._file: BinaryIO | None = None
        self._partial = b""

    def read_lines(self) -> list[bytes]:
        """The complete lines added since the last call that may hold a lease line."""
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
            except OSError:
                return []  # not written yet
        if os.fstat(self._file.fileno()).st_size < self._file.tell():
            self._file.seek(0)
            self._partial = b""
        chunks = [self._partial]
        total = 0
        while total < _MAX_READ_PER_POLL:
            chunk = self._file.read(_READ_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        data = b"".join(chunks)
        complete, _, self._partial = data.rpartition(b"\n")
        if len(self._partial) > _MAX_PARTIAL:
            self._partial = b""
        if not any(marker in complete for marker in _MARKERS):  # nearly always: skip the split
            return []
        return [line for line in complete.split(b"\n") if any(m in line for m in _MARKERS)]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class LogWatcher:
    """Follows ``logs`` (instance URL → log file) on a thread of its own and calls ``on_event``."""

    def __init__(
        self,
        logs: Mapping[str, Path],
        on_event: Callable[[KVLogEvent], None],
        poll_s: float = 0.1,
    ) -> None:
        self._followers = [_Follower(url, Path(path)) for url, path in logs.items()]
        self._on_event = on_event
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-logwatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for follower in self._followers:
            follower.close()

    def poll(self) -> int:
        """Read what is new in every log once; returns the number of events reported."""
        num_events = 0
        for follower in self._followers:
            for raw in follower.read_lines():
                parsed = parse_line(raw.decode(errors="replace"))
                if parsed is None:
                    continue
                kind, request_id = parsed
                try:
                    self._on_event(KVLogEvent(follower.url, kind, request_id, at=time.monotonic()))
                except Exception:
                    log.exception("delivering a log event from %s failed", follower.path)
                num_events += 1
        return num_events

    def _run(self) -> None:
        while not self._stopping.wait(self._poll_s):
            try:
                self.poll()
            except OSError as exc:  # a log on a disk that went away: say so once a poll, keep going
                log.warning("reading instance logs: %s", exc)
