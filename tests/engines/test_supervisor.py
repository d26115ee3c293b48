"""The Supervisor against fake engines (tests/engines/fake_engine.py): crashes, backoff, crash loops, stop."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_launcher import FAKE_ENGINE, fake_spec, group_is_running, health_status, port_is_free

from pdserve.engines.launcher import EngineGroup
from pdserve.engines.placement import InstanceSpec
from pdserve.engines.stranded import InFlight
from pdserve.engines.supervisor import RestartPolicy, Supervisor, restart_hint
from pdserve.errors import ConfigError
from pdserve.events import InstanceEvent

FAST = RestartPolicy(first_backoff_s=0.2, max_backoff_s=5.0, poll_s=0.05)


class Recorder:
    """What the supervisor reported, in order, with the time each event arrived."""

    def __init__(self) -> None:
        self.events: list[tuple[float, InstanceEvent]] = []
        self.messages: list[str] = []
        self._changed = threading.Condition()

    def on_event(self, event: InstanceEvent) -> None:
        with self._changed:
            self.events.append((time.monotonic(), event))
            self._changed.notify_all()

    def kinds(self, url: str) -> list[str]:
        return [e.kind for _, e in self.events if e.url == url]

    def wait_for(self, url: str, kind: str, count: int = 1, timeout: float = 15.0) -> InstanceEvent:
        with self._changed:
            ok = self._changed.wait_for(lambda: self.kinds(url).count(kind) >= count, timeout)
        assert ok, f"no {kind!r} #{count} for {url} within {timeout} s; saw {self.kinds(url)}"
        return [e for _, e in self.events if e.url == url and e.kind == kind][count - 1]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def supervised(tmp_path: Path, recorder: Recorder) -> Iterator[Callable[..., tuple[EngineGroup, Supervisor]]]:
    made: list[tuple[EngineGroup, Supervisor]] = []

    def make(
        *specs: InstanceSpec, policy: RestartPolicy = FAST, in_flight: InFlight | None = None
    ) -> tuple[EngineGroup, Supervisor]:
        group = EngineGroup(specs, sys.executable, tmp_path, 10.0, entrypoint=(FAKE_ENGINE,))
        group.start()
        supervisor = Supervisor(group, recorder.on_event, recorder.messages.append, policy, in_flight)
        supervisor.start()
        made.append((group, supervisor))
        return group, supervisor

    yield make
    for group, supervisor in made:
        supervisor.stop()
        group.stop(timeout=2.0)


def _kill(group: EngineGroup, spec: InstanceSpec) -> int:
    pid = group.pid(spec)
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    return pid


def test_a_killed_instance_is_restarted_on_its_port_and_reported_back(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder
) -> None:
    prefill, decode = fake_spec("prefill", 0), fake_spec("decode", 0)
    group, _ = supervised(prefill, decode)
    prefill_pid = group.pid(prefill)
    old_pid = _kill(group, decode)
    exited = recorder.wait_for(decode.url, "exited")
    assert exited.detail == "was killed by SIGKILL"
    ready = recorder.wait_for(decode.url, "ready")
    assert recorder.kinds(decode.url) == ["exited", "restarting", "ready"]
    assert "healthy" in ready.detail
    assert health_status(decode) == 200
    assert group.pid(decode) not in (None, old_pid)
    assert group.pid(prefill) == prefill_pid and recorder.kinds(prefill.url) == []  # left alone
    # The operator sees why it went down: the end of its log, the run before the crash included.
    said = "\n".join(recorder.messages)
    assert "decode-0 was killed by SIGKILL; last lines of" in said and "fake engine serving" in said
    assert "decode-0 is back" in said
    assert group.log_path(decode).read_text().count("# pdserve:") == 2


def test_restarts_back_off_exponentially_while_the_instance_keeps_failing(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    spec = fake_spec("prefill", 0, "--crash-if-exists", str(broken))
    policy = RestartPolicy(first_backoff_s=0.3, max_backoff_s=1.2, max_restarts=10, poll_s=0.05)
    group, _ = supervised(spec, policy=policy)
    broken.touch()  # from now on every start fails
    _kill(group, spec)
    recorder.wait_for(spec.url, "restarting", count=5, timeout=30)
    times = {kind: [t for t, e in recorder.events if e.kind == kind] for kind in ("exited", "restarting")}
    waits = [restart - exit_ for exit_, restart in zip(times["exited"], times["restarting"], strict=False)]
    for wait, expected in zip(waits, (0.3, 0.6, 1.2, 1.2, 1.2), strict=True):  # doubling, capped
        assert expected - 0.05 <= wait < expected + 0.5, waits
    broken.unlink()  # fixed: the next restart succeeds
    recorder.wait_for(spec.url, "ready", timeout=15)
    assert health_status(spec) == 200


def test_a_crash_loop_is_given_up_on_while_the_rest_keep_serving(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    looping = fake_spec("decode", 0, "--crash-if-exists", str(broken))
    steady = fake_spec("decode", 1)
    policy = RestartPolicy(first_backoff_s=0.1, max_backoff_s=0.2, max_restarts=2, poll_s=0.05)
    group, _ = supervised(looping, steady, policy=policy)
    broken.touch()
    _kill(group, looping)
    gave_up = recorder.wait_for(looping.url, "gave_up", timeout=20)
    assert "3 exits within 600 s" in gave_up.detail and "exited with code 3" in gave_up.detail
    assert recorder.kinds(looping.url).count("restarting") == 2
    time.sleep(1.0)  # it stays down: no further restart
    assert recorder.kinds(looping.url)[-1] == "gave_up"
    assert port_is_free(looping.port)
    assert health_status(steady) == 200 and recorder.kinds(steady.url) == []
    assert "RuntimeError: fake engine failed to allocate KV cache" in "\n".join(recorder.messages)


def test_stop_interrupts_a_restart_in_progress_and_leaves_no_process(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    slow = tmp_path / "slow"
    spec = fake_spec("prefill", 0, "--slow-if-exists", str(slow), "--child")
    group, supervisor = supervised(spec)
    slow.touch()  # the restart will take a minute to become healthy
    _kill(group, spec)
    recorder.wait_for(spec.url, "restarting")
    new_pid = group.pid(spec)
    assert new_pid is not None and group_is_running(new_pid)
    began = time.monotonic()
    supervisor.stop()
    group.stop(timeout=2.0)
    assert time.monotonic() - began < 3
    assert not group_is_running(new_pid)
    assert "ready" not in recorder.kinds(spec.url)


def test_stop_during_the_backoff_restarts_nothing(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder
) -> None:
    spec = fake_spec("prefill", 0)
    group, supervisor = supervised(spec, policy=RestartPolicy(first_backoff_s=30, poll_s=0.05))
    old_pid = _kill(group, spec)
    recorder.wait_for(spec.url, "exited")
    began = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - began < 1
    assert recorder.kinds(spec.url) == ["exited"] and group.pid(spec) == old_pid


@pytest.mark.parametrize(
    ("field", "value"),
    [("first_backoff_s", 0), ("max_backoff_s", 0.5), ("max_restarts", 0), ("window_s", -1), ("poll_s", 0)],
)
def test_a_bad_restart_policy_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        RestartPolicy(**{field: value})  # type: ignore[arg-type]


def test_a_restart_held_up_by_a_taken_port_says_why_and_goes_ahead_once_it_is_free(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder
) -> None:
    spec = fake_spec("prefill", 0)
    group, _ = supervised(spec, policy=RestartPolicy(first_backoff_s=1.0, poll_s=0.05))
    _kill(group, spec)
    recorder.wait_for(spec.url, "exited")
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", spec.side_channel_port))
        squatter.listen()
        deadline = time.monotonic() + 15
        while not any("cannot restart yet" in m for m in recorder.messages) and time.monotonic() < deadline:
            time.sleep(0.1)
        said = [m for m in recorder.messages if "cannot restart yet" in m]
        assert said and f"port {spec.side_channel_port}" in said[0], recorder.messages
        assert "restarting" not in recorder.kinds(spec.url)
    recorder.wait_for(spec.url, "ready")


def test_a_restart_refused_for_gpu_memory_another_process_holds_says_what_to_do() -> None:
    # vLLM 0.26's own words, from a prefill restarted beside a live decode on one H200 (docs/gpu.md)
    tail = (
        "(EngineCore pid=3388) ValueError: Free memory on device cuda:0 (13.19/139.8 GiB) on startup is less "
        "than desired GPU memory utilization (0.45, 62.91 GiB). Decrease GPU memory utilization or reduce GPU "
        "memory used by other processes."
    )
    hint = restart_hint(tail)
    assert hint is not None and "13.19 of 139.8 GiB" in hint and "until that decode restarts" in hint
    assert restart_hint("RuntimeError: fake engine failed to allocate KV cache") is None


def _on_gpu(spec: InstanceSpec, gpu: str, stage: int = 0) -> InstanceSpec:
    return dataclasses.replace(spec, env=(("CUDA_VISIBLE_DEVICES", gpu),), start_stage=stage)


def _span(recorder: Recorder, url: str) -> tuple[float, float]:
    """When its last restart began and when it was healthy again."""
    began = [t for t, e in recorder.events if e.url == url and e.kind == "restarting"][-1]
    ready = [t for t, e in recorder.events if e.url == url and e.kind == "ready"][-1]
    return began, ready


def test_a_prefill_refused_its_gpu_memory_gets_it_back_by_a_restart_of_the_decodes_that_hold_it(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    # The fakes act out the H200: while the decode runs, a new prefill finds the dead one's memory held.
    decode_pid = tmp_path / "decode.pid"
    prefill = _on_gpu(fake_spec("prefill", 0, "--gpu-held-by", str(decode_pid)), "0")
    decode = _on_gpu(fake_spec("decode", 0, "--write-pid", str(decode_pid), "--delay", "0.5"), "0", stage=1)
    group, _ = supervised(prefill, decode)
    _kill(group, prefill)
    recycled = recorder.wait_for(decode.url, "exited")
    assert "to free prefill-0's GPU memory" in recycled.detail
    recorder.wait_for(prefill.url, "ready", timeout=20)
    recorder.wait_for(decode.url, "ready", timeout=20)
    assert recorder.kinds(prefill.url) == ["exited", "restarting", "exited", "restarting", "ready"]
    assert recorder.kinds(decode.url) == ["exited", "restarting", "ready"]
    # Prefill first, decode once prefill was healthy: never two vLLM start-ups on one GPU at once.
    assert _span(recorder, prefill.url)[1] <= _span(recorder, decode.url)[0]
    said = "\n".join(recorder.messages)
    assert "only 13.19 of 139.8 GiB of its GPU are free" in said
    assert "decode-0 restarted to free prefill-0's GPU memory" in said
    assert health_status(prefill) == 200 and health_status(decode) == 200


def test_a_prefill_still_refused_after_the_decodes_restarted_does_not_restart_them_again(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    # Something else holds the memory (the pid file names this test's own process): the decodes were
    # restarted once to no avail, and the prefill crash-loops alone while the decode keeps serving.
    holder = tmp_path / "holder.pid"
    prefill = _on_gpu(fake_spec("prefill", 0, "--gpu-held-by", str(holder)), "0")
    decode = _on_gpu(fake_spec("decode", 0), "0", stage=1)
    group, _ = supervised(
        prefill, decode, policy=RestartPolicy(first_backoff_s=0.1, max_restarts=3, poll_s=0.05)
    )
    holder.write_text(str(os.getpid()))
    _kill(group, prefill)
    recorder.wait_for(prefill.url, "gave_up", timeout=20)
    recorder.wait_for(decode.url, "ready", timeout=20)
    assert recorder.kinds(decode.url) == ["exited", "restarting", "ready"]  # once, not per refusal
    assert health_status(decode) == 200


def test_instances_sharing_a_gpu_restart_one_at_a_time(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder
) -> None:
    prefill = _on_gpu(fake_spec("prefill", 0, "--delay", "1.0"), "0")
    decode = _on_gpu(fake_spec("decode", 0, "--delay", "1.0"), "0", stage=1)
    other = _on_gpu(fake_spec("decode", 1, "--delay", "1.0"), "1")  # its own GPU: no need to wait
    group, _ = supervised(prefill, decode, other)
    for spec in (prefill, decode, other):
        _kill(group, spec)
    for spec in (prefill, decode, other):
        recorder.wait_for(spec.url, "ready", timeout=20)
    first, second = sorted([_span(recorder, prefill.url), _span(recorder, decode.url)])
    assert first[1] <= second[0], "two instances started on GPU 0 at once"
    assert _span(recorder, other.url)[0] < first[1]  # GPU 1 did not wait for GPU 0


def test_the_gpu_memory_hint_is_read_above_vllms_traceback_but_never_from_an_earlier_run(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    # vLLM prints the engine core's ValueError, then ~60 lines of the API server's traceback: the cause is
    # above the tail the operator is shown. A run before the latest one does not count.
    decode_pid = tmp_path / "decode.pid"
    prefill = _on_gpu(
        fake_spec("prefill", 0, "--gpu-held-by", str(decode_pid), "--traceback-lines", "80"), "0"
    )
    decode = _on_gpu(fake_spec("decode", 0, "--write-pid", str(decode_pid)), "0", stage=1)
    group, _ = supervised(prefill, decode)
    _kill(group, prefill)
    assert "to free prefill-0's GPU memory" in recorder.wait_for(decode.url, "exited").detail
    recorder.wait_for(prefill.url, "ready", timeout=20)
    recorder.wait_for(decode.url, "ready", timeout=20)
    decode_pid.unlink()  # this time decode maps nothing of prefill's
    _kill(group, prefill)  # its log still holds the refusal of two runs ago: decode is left alone
    recorder.wait_for(prefill.url, "ready", count=2, timeout=20)
    assert recorder.kinds(decode.url) == ["exited", "restarting", "ready"]


def _push_decode(metrics: Path, registration_timeout_s: int) -> InstanceSpec:
    config = ('{"kv_connector":"NixlPushConnector","kv_role":"kv_consumer",'
              f'"kv_connector_extra_config":{{"push_registration_timeout":{registration_timeout_s}}}}}')  # fmt: skip
    return fake_spec("decode", 0, "--metrics-file", str(metrics), "--kv-transfer-config", config)


def _counters(running: int, waiting: int, usage: float, deferred: int = 0) -> str:
    return (f"vllm:num_requests_running{{engine=\"0\"}} {running}\n"
            f"vllm:num_requests_waiting{{engine=\"0\"}} {waiting}\nvllm:kv_cache_usage_perc{{engine=\"0\"}} {usage}\n"
            f"vllm:num_requests_waiting_by_reason{{engine=\"0\",reason=\"deferred\"}} {deferred}\n")  # fmt: skip


def test_a_push_decode_idle_yet_holding_blocks_past_its_registration_watchdog_is_restarted_to_free_them(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    metrics = tmp_path / "metrics"
    metrics.write_text(_counters(running=0, waiting=0, usage=0.02))  # blocks registered for a dead prefill
    decode = _push_decode(metrics, registration_timeout_s=1)
    began = time.monotonic()
    supervised(decode, policy=dataclasses.replace(FAST, stranded_check_s=0.2))
    recycled = recorder.wait_for(decode.url, "exited")
    assert time.monotonic() - began > 1.0  # not before vLLM's own watchdog gave up on the push
    assert "KV blocks registered for a push that never came" in recycled.detail
    metrics.write_text(_counters(running=0, waiting=0, usage=0.0))  # what the restart frees
    recorder.wait_for(decode.url, "ready")
    time.sleep(1.5)
    assert recorder.kinds(decode.url) == ["exited", "restarting", "ready"]
    assert "decode-0 restarted to free KV blocks" in "\n".join(recorder.messages)


@pytest.mark.parametrize(
    "counters",
    [_counters(running=1, waiting=0, usage=0.02), _counters(running=0, waiting=0, usage=0.0)],
    ids=["busy", "holding-nothing"],
)
def test_a_push_decode_that_is_busy_or_holds_nothing_is_left_alone(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]],
    recorder: Recorder,
    tmp_path: Path,
    counters: str,
) -> None:
    metrics = tmp_path / "metrics"
    metrics.write_text(counters)
    decode = _push_decode(metrics, registration_timeout_s=1)
    supervised(decode, policy=dataclasses.replace(FAST, stranded_check_s=0.2))
    time.sleep(2.5)
    assert recorder.kinds(decode.url) == []


def test_a_push_left_waiting_deferred_is_restarted_away_only_once_the_proxy_awaits_nothing_there(
    supervised: Callable[..., tuple[EngineGroup, Supervisor]], recorder: Recorder, tmp_path: Path
) -> None:
    metrics = tmp_path / "metrics"
    # vLLM keeps a dead prefill's push waiting (deferred, "KV fetch in progress") with its blocks
    metrics.write_text(_counters(running=0, waiting=1, usage=0.02, deferred=1))
    decode = _push_decode(metrics, registration_timeout_s=1)
    proxy_in_flight = {decode.url: 1}  # a push the proxy still awaits, within its prefill timeout
    asked: list[str] = []

    def in_flight(url: str) -> int | None:
        asked.append(url)
        return proxy_in_flight[url]

    supervised(decode, policy=dataclasses.replace(FAST, stranded_check_s=0.2), in_flight=in_flight)
    time.sleep(2.0)
    assert recorder.kinds(decode.url) == [] and asked  # left alone while the proxy awaits it
    proxy_in_flight[decode.url] = 0  # the proxy gave up on it: nothing will ever free those blocks
    assert "KV blocks registered for a push that never came" in recorder.wait_for(decode.url, "exited").detail
