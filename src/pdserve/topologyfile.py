"""A topology file (YAML) → ``Topology``: the accepted shape, every key checked, none silently ignored.

``config.py`` validates the values; this module only maps the file's shape (roles as ``prefill: {count,
args, hosts, resources}``) onto the dataclass's flat fields, and turns YAML and file errors into
``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from pdserve.config import ROLES, Topology
from pdserve.errors import ConfigError

_TOPOLOGY_FIELDS = {f.name for f in dataclasses.fields(Topology)}
_TUPLE_FIELDS = ("vllm_args", "prefill_args", "decode_args", "prefill_hosts", "decode_hosts")


def topology_from_mapping(data: dict[str, Any], base: Topology | None = None) -> Topology:
    """Build a Topology from a YAML mapping; unknown keys are an error, not silently ignored.

    Accepted shape (every key optional)::

        model: /path/to/model
        prefill: {count: 2, args: ["--max-num-seqs", "64"], hosts: [10.0.0.2, 10.0.0.3]}
        decode: {count: 2}
        proxy_port: 8000
        vllm_args: ["--enforce-eager"]
        on_instance_exit: restart    # or stop
        ray: 10.0.0.2:6379           # on a Ray cluster, with per role: resources: {pdserve_prefill: 1}
    """
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in ROLES:
            if not isinstance(value, dict) or set(value) - {"count", "args", "hosts", "resources"}:
                raise ConfigError(
                    f"topology.{key} must be a mapping with 'count', 'args', 'hosts' and/or 'resources'"
                )
            if "count" in value:
                values[f"num_{key}"] = value["count"]
            if "resources" in value:
                values[f"{key}_resources"] = resource_pairs(f"topology.{key}.resources", value["resources"])
            for part in ("args", "hosts"):
                if part in value:
                    values[f"{key}_{part}"] = value[part]
        elif key in _TOPOLOGY_FIELDS:
            values[key] = value
        else:
            allowed = sorted((_TOPOLOGY_FIELDS | set(ROLES)) - {"num_prefill", "num_decode"})
            raise ConfigError(f"unknown topology key {key!r}; valid keys: {', '.join(allowed)}")
    for key in _TUPLE_FIELDS:
        if key in values:
            if not isinstance(values[key], list | tuple):
                raise ConfigError(f"topology.{key} must be a list of strings")
            values[key] = tuple(str(v) for v in values[key])
    try:
        return dataclasses.replace(base or Topology(), **values)
    except TypeError as exc:
        raise ConfigError(f"invalid topology: {exc}") from exc


def resource_pairs(where: str, value: object) -> tuple[tuple[str, float], ...]:
    """A YAML mapping of Ray resources ({pdserve_prefill: 1}) as the Topology's sorted pairs."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of Ray resource names to amounts, got {value!r}")
    try:
        return tuple(sorted((str(name), float(amount)) for name, amount in value.items()))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: every amount must be a number ({exc})") from exc


def load_topology(path: str | Path, base: Topology | None = None) -> Topology:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read topology file {path}: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"topology file {path} must hold a mapping at the top level")
    return topology_from_mapping(data, base)
