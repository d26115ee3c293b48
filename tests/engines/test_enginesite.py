"""engines/enginesite/sitecustomize.py in the engine venv's own Python, with its real NIXL: what the
launcher gives every vLLM process it starts. NIXL's agent hard-codes a progress-thread poll delay of 0
(a spinning core); with the launcher's setting the agent's config carries the delay instead."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pdserve.engines.launcher import _instance_env
from pdserve.engines.placement import InstanceSpec

ENGINESITE = Path(__file__).parents[2] / "src" / "pdserve" / "engines" / "enginesite"

# Builds a config the way nixl_agent.__init__ does (nixlBind.nixlAgentConfig(), then pthrDelay = 0), then
# starts a real agent with the UCX backend, as vLLM's NIXL connector does.
PROBE = """
import nixl._api as api
config = api.nixlBind.nixlAgentConfig()
config.pthrDelay = 0
print(api.__name__, config.pthrDelay)
agent = api.nixl_agent("probe", api.nixl_agent_config(num_threads=4))
print("agent started")
"""


def _run(engine_python: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [engine_python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )


def _spec(env: tuple[tuple[str, str], ...]) -> InstanceSpec:
    return InstanceSpec("prefill", 0, "127.0.0.1", 1, 2, (), env)


def test_an_instance_told_to_pause_nixls_progress_thread_gets_the_delay_in_every_nixl_agent(
    engine_python: str,
) -> None:
    env = _instance_env(_spec((("PDSERVE_NIXL_PROGRESS_DELAY_US", "100"),)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ENGINESITE)
    result = _run(engine_python, env)
    assert "._api 100" in result.stdout and "agent started" in result.stdout, result
    assert "NIXL progress thread polls every 100 us" in result.stderr


def test_without_the_setting_nixl_is_left_as_it_is(engine_python: str) -> None:
    env = _instance_env(_spec(()))
    assert str(ENGINESITE) not in env.get("PYTHONPATH", "")
    result = _run(
        engine_python, {**env, "PYTHONPATH": str(ENGINESITE)}
    )  # on the path, but not asked to do anything
    assert "._api 0" in result.stdout and "agent started" in result.stdout, result
    assert "enginesite" not in result.stderr


def test_an_instances_own_pythonpath_is_kept_behind_enginesite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/mine")
    env = _instance_env(_spec((("PDSERVE_NIXL_PROGRESS_DELAY_US", "100"),)))
    assert env["PYTHONPATH"] == os.pathsep.join([str(ENGINESITE), "/opt/mine"])
