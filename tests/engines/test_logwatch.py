"""The prefill log watcher on a temp file written the way vLLM 0.32 and the launcher write it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdserve.engines.logwatch import LogWatcher, parse_line
from pdserve.events import KVLogEvent

URL = "http://127.0.0.1:8100"
RID = "cmpl-b0d63e2268714dc6931514ed07fd6fc5-0-8e84071c"
# As found in a prefill log of this machine (vLLM's worker prefix, then the message).
EXPIRED = (
    f"(Worker pid=4860) WARNING 12-02 18:30:24 [base_worker.py:3032] Releasing expired KV blocks for request "
    f"{RID} which were retrieved by 0 remote worker(s) before lease expired.\n"
)
LATE = (
    f"(Worker pid=4860) ERROR 12-02 18:30:25 [pull_worker.py:667] Potentially invalid KV blocks for "
    f"unrecognized request {RID} were retrieved by a decode worker. They may have expired.\n"
)
PULLED_THEN_EXPIRED = EXPIRED.replace("by 0 remote", "by 1 remote")
NOISE = "(APIServer pid=4790) INFO 12-02 18:30:20 [loggers.py:123] Engine 000: Avg prompt throughput\n"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (EXPIRED, ("expired", RID)),
        (LATE, ("late_pull", RID)),
        (PULLED_THEN_EXPIRED, None),  # read before the lease ran out: nothing wrong
        (EXPIRED.replace("by 0 remote", "by 10 remote"), None),
        (NOISE, None),
    ],
)
def test_only_unpulled_expiries_and_late_pulls_count(line: str, expected: object) -> None:
    assert parse_line(line) == expected


def _watcher(logs: dict[str, Path]) -> tuple[LogWatcher, list[KVLogEvent]]:
    events: list[KVLogEvent] = []
    return LogWatcher(logs, events.append), events


def test_lines_are_reported_once_each_as_the_log_grows(tmp_path: Path) -> None:
    log = tmp_path / "prefill-0.log"
    log.write_text("# pdserve: python -m vllm...\n" + NOISE + EXPIRED)
    watcher, events = _watcher({URL: log})
    before = time.monotonic()
    assert watcher.poll() == 1
    assert events[0] == KVLogEvent(URL, "expired", RID, at=events[0].at) and events[0].at >= before
    assert watcher.poll() == 0  # nothing new, nothing repeated
    with log.open("a") as out:
        out.write(NOISE + LATE)
    assert watcher.poll() == 1 and events[1].kind == "late_pull"


def test_a_line_written_in_two_pieces_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "prefill-0.log"
    half = len(EXPIRED) // 2
    log.write_text(EXPIRED[:half])
    watcher, events = _watcher({URL: log})
    assert watcher.poll() == 0
    with log.open("a") as out:
        out.write(EXPIRED[half:])
    assert watcher.poll() == 1 and events[0].remote_request_id == RID


def test_a_restart_appending_to_the_log_and_a_log_not_there_yet_are_followed(tmp_path: Path) -> None:
    first, later = tmp_path / "prefill-0.log", tmp_path / "prefill-1.log"
    first.write_text(EXPIRED)
    watcher, events = _watcher({URL: first, "http://127.0.0.1:8101": later})
    assert watcher.poll() == 1
    with first.open("a") as out:  # the launcher restarts the instance: same file, appended
        out.write("# pdserve: python -m vllm...\n" + LATE.replace(RID, "cmpl-new-0-1"))
    later.write_text(LATE)
    assert watcher.poll() == 2
    assert {(e.url, e.remote_request_id) for e in events[1:]} == {
        (URL, "cmpl-new-0-1"),
        ("http://127.0.0.1:8101", RID),
    }


def test_a_truncated_log_is_read_again_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "prefill-0.log"
    log.write_text(NOISE * 20 + EXPIRED)
    watcher, events = _watcher({URL: log})
    assert watcher.poll() == 1
    log.write_text(LATE)  # a fresh start over the same file ("wb")
    assert watcher.poll() == 1 and events[1].kind == "late_pull"


def test_the_thread_reports_within_a_fraction_of_a_second(tmp_path: Path) -> None:
    log = tmp_path / "prefill-0.log"
    log.write_text(NOISE)
    watcher, events = _watcher({URL: log})
    watcher.start()
    try:
        time.sleep(0.2)
        written = time.monotonic()
        with log.open("a") as out:
            out.write(EXPIRED)
        deadline = written + 2.0
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events and events[0].at - written < 0.5
    finally:
        watcher.stop()
