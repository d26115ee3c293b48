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

Python runs only the first ``sitecustomize`` on its path: this one then runs the next one, if any.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"


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


class _NixlFinder(importlib.abc.MetaPathFinder):
    """Patches ``nixl*._api`` as it is imported, so nothing is imported before vLLM asks for it."""

    def __init__(self, delay_us: int) -> None:
        self._delay_us = delay_us

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not (name.startswith("nixl") and name.endswith("._api")):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if spec is None or not isinstance(loader, importlib.abc.Loader):
            return None
        exec_module = loader.exec_module
        delay_us = self._delay_us

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            try:
                if hasattr(module, "nixl_agent"):
                    _patch(module, delay_us)
            except Exception as exc:  # never break vLLM's start-up over a tuning
                _say(f"could not set NIXL's progress delay ({exc!r}): left as is")

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _install() -> None:
    try:
        delay_us = int(os.environ.get(_ENV, "0") or 0)
    except ValueError:
        _say(f"{_ENV}={os.environ[_ENV]!r} is not a whole number of microseconds: NIXL left as is")
        return
    if delay_us > 0:
        sys.meta_path.insert(0, _NixlFinder(delay_us))


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
