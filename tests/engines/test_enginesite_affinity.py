"""enginesite/sitecustomize.py keeps a vLLM CPU worker on its own cores: vLLM's NIXL worker moves the
thread that runs the model to the last core of each NUMA node, and the override leaves it where it is.
Checked against the engine venv's own vLLM: if vLLM changes that call, these fail and say where to look."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from pdserve.engines.launcher import _instance_env
from pdserve.engines.placement import InstanceSpec

ENGINESITE = Path(__file__).parents[2] / "src" / "pdserve" / "engines" / "enginesite"
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_REVISIT = (
    "vLLM changed its NIXL worker's CPU affinity call: revisit enginesite/sitecustomize.py (docs/vllm.md)"
)

# Where vLLM is, without importing it (that imports torch).
_LOCATE = "import importlib.util; print(list(importlib.util.find_spec('vllm').submodule_search_locations)[0])"

# Pin this thread to one core, import vLLM's NIXL worker module as a vLLM worker would, make the call it
# makes, and report where the thread is then.
_PROBE = f"""
import json, os
first = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {{first}})
import {WORKER_MODULE} as worker
others = sorted(set(range(os.cpu_count())) - {{first}})
worker.os.sched_setaffinity(0, others or [first])
print(json.dumps({{"first": first, "others": others, "after": sorted(os.sched_getaffinity(0)),
                  "patched": worker.os is not os}}))
"""


def _vllm_dir(engine_python: str) -> Path:
    proc = subprocess.run(
        [engine_python, "-c", _LOCATE], capture_output=True, text=True, timeout=60, check=True
    )
    return Path(proc.stdout.strip())


def test_vllms_nixl_worker_still_moves_its_own_thread_with_one_module_level_os_call(
    engine_python: str,
) -> None:
    source = (_vllm_dir(engine_python) / Path(*WORKER_MODULE.split(".")[1:])).with_suffix(".py").read_text()
    assert re.search(r"^import os$", source, re.MULTILINE), _REVISIT
    calls = re.findall(r"\bos\.sched_setaffinity\(([^)]*)\)", source)
    assert calls == ["0, rsv_cores_for_kv"], f"{_REVISIT}: found {calls}"
    assert "discover_numa_topology()" in source, _REVISIT


def test_the_override_keeps_the_worker_on_its_cores(engine_python: str) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        raise AssertionError("this test needs two cores to see a thread moved")
    env = _instance_env(
        InstanceSpec("prefill", 0, "127.0.0.1", 1, 2, (), (("PDSERVE_NIXL_PROGRESS_DELAY_US", "100"),))
    )
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ENGINESITE)
    kept = subprocess.run([engine_python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert kept.returncode == 0, kept.stderr[-3000:]
    result = json.loads(kept.stdout.strip().splitlines()[-1])
    assert result["patched"] and result["after"] == [result["first"]], result
    assert f"asked to move its model thread to cores {result['others']}" in kept.stderr

    moved = subprocess.run(
        [engine_python, "-c", _PROBE], env={**env, "PDSERVE_KEEP_CPU_AFFINITY": "0"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert moved.returncode == 0, moved.stderr[-3000:]
    result = json.loads(moved.stdout.strip().splitlines()[-1])
    assert not result["patched"] and result["after"] == result["others"], result
