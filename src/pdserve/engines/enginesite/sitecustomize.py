"""Run by Python at start-up in every process of a vLLM instance pdserve launches (the launcher puts this
directory first on the instance's PYTHONPATH): never imported by pdserve itself, and it imports nothing of
pdserve, since vLLM's venv does not have it.

What it does: NIXL's Python agent starts its progress thread with a poll delay of 0 (``pthrDelay = 0`` in
``nixl._api``, no option to change it), so every NIXL agent, i.e. every vLLM worker with a NixlConnector,
spins one core at 100 % from start-up on, idle or not. On a host with few cores that starves the engines
themselves: on a 2-core machine a 1P1D pair idled at a load average of 25, prefill's lease notifications
and decode's pulls came seconds late, and KV leases ran out before decode read the blocks. With
``PDSERVE_NIXL_PROGRESS_DELAY_US`` set, the progress thread waits that long between polls instead (100 µs:
about 3 % of a core when idle). Unset or 0: NIXL's own behaviour. Anything unexpected (another NIXL
version's internals) leaves NIXL as it is and says so in the instance's log.

It also keeps each vLLM CPU worker computing on the cores pdserve gave it. vLLM's NIXL connector
(``nixl/base_worker.py``: "reserve different cores for start_load_kv() from model_forward()") calls
``os.sched_setaffinity(0, <the last core of each NUMA node>)`` from the worker's main thread, which is
also the thread that runs the model (OpenMP's master). It does so whatever ``VLLM_CPU_OMP_THREADS_BIND``
says, so every instance on a host ends up computing on the same core: on a 2-core machine prefill and
decode both ran on core 1 while core 0 idled, and PD's time to first token was 1.2-1.5 s against 0.15 s for
one instance. That one call, and only in that module, leaves the thread where it is and says so in the
log. ``PDSERVE_KEEP_CPU_AFFINITY=0`` lets vLLM move it (to measure the difference).

Python runs only the first ``sitecustomize`` on its path: this one then runs the next one, if any.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"
_AFFINITY_ENV = "PDSERVE_KEEP_CPU_AFFINITY"
# The module whose sched_setaffinity call is kept from moving the worker (tests/engines check it is there).
NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


def _say(message: str) -> None:
    print(f"pdserve enginesite (pid {os.getpid()}): {message}", file=sys.stderr, flush=True)


def _patch(module: ModuleType, delay_us: int) -> None:
    """Make ``module`` (a NIXL ``_api``) give its agents' progress thread ``delay_us`` between polls."""
    binding = getattr(module, "nixlBind", None)
    config_type = getattr(binding, "nixlAgentConfig", None)
    field: Any = getattr(config_type, "pthrDelay", None)
    if binding is None or config_type is None or not hasattr(field, "__set__"):
        _say(
            f"{module.__name__} has no nixlBind.nixlAgentConfig.pthrDelay: NIXL's progress thread left as is"
        )
        return

    class _Delayed(config_type):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> Any:
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: Any) -> None:
            field.__set__(self, delay_us if value == 0 else value)

    class _Binding:
        """``nixlBind`` as the module sees it, with the delayed config type."""

        nixlAgentConfig = _Delayed

        def __getattr__(self, name: str) -> Any:
            return getattr(binding, name)

    module.nixlBind = _Binding()  # type: ignore[attr-defined]
    _say(f"NIXL progress thread polls every {delay_us} us ({module.__name__})")


class _KeptAffinityOs:
    """``os`` as vLLM's NIXL worker module sees it: ``sched_setaffinity(0, ...)`` keeps the calling thread
    on the cores it has (those ``VLLM_CPU_OMP_THREADS_BIND`` gave it); everything else is ``os``."""

    def sched_setaffinity(self, pid: int, mask: Any) -> None:
        if pid != 0:
            os.sched_setaffinity(pid, mask)
            return
        kept = sorted(os.sched_getaffinity(0))
        _say(
            f"vLLM's NIXL worker asked to move its model thread to cores {sorted(mask)}; "
            f"it stays on {kept}, the cores pdserve gave this instance"
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def _keep_affinity(module: ModuleType) -> None:
    if getattr(module, "os", None) is not os:
        _say(f"{module.__name__} has no module-level os: its CPU affinity call left as is")
        return
    module.os = _KeptAffinityOs()  # type: ignore[attr-defined]


def _is_nixl_api(name: str) -> bool:
    return name.startswith("nixl") and name.endswith("._api")


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Patches the modules ``matches`` accepts as they are imported, so nothing is imported before vLLM
    asks for it."""

    def __init__(self, matches: Callable[[str], bool], patch: Callable[[ModuleType], None]) -> None:
        self._matches = matches
        self._patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not self._matches(name):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if spec is None or not isinstance(loader, importlib.abc.Loader):
            return None
        exec_module = loader.exec_module
        patch = self._patch

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            try:
                patch(module)
            except Exception as exc:  # never break vLLM's start-up over a tuning
                _say(f"could not patch {name} ({exc!r}): left as is")

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _install() -> None:
    if os.environ.get(_AFFINITY_ENV, "1") != "0":
        sys.meta_path.insert(0, _PatchingFinder(lambda name: name == NIXL_WORKER_MODULE, _keep_affinity))
    try:
        delay_us = int(os.environ.get(_ENV, "0") or 0)
    except ValueError:
        _say(f"{_ENV}={os.environ[_ENV]!r} is not a whole number of microseconds: NIXL left as is")
        return
    if delay_us > 0:

        def delay(module: ModuleType) -> None:
            if hasattr(module, "nixl_agent"):
                _patch(module, delay_us)

        sys.meta_path.insert(0, _PatchingFinder(_is_nixl_api, delay))


def _run_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        directory = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(directory, "sitecustomize.py")
        if directory != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_pdserve_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_install()
_run_next_sitecustomize()
