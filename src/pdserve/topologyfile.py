"""A topology file (YAML) → ``Topology``: the accepted shape, every key checked, none silently ignored.

``config.py`` validates the values; this module only maps the file's shape onto the dataclass (a role's
``prefill: {count, args, hosts, resources}`` is its ``RoleSpec``, and so is an elastic pool's
``elastic: {count, ...}``), and turns YAML and file errors into ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from pdserve.config import INSTANCE_ROLES, Role
from pdserve.errors import ConfigError
from pdserve.topology import Resources, RoleSpec, Topology

_TOPOLOGY_FIELDS = {f.name for f in dataclasses.fields(Topology)} - set(INSTANCE_ROLES)
_ROLE_KEYS = {f.name for f in dataclasses.fields(RoleSpec)}
_TUPLE_KEYS = ("args", "hosts")
# The flat spellings a topology file may also use (docs/deploying.md shows prefill_hosts): each is a key
# of its role's mapping, e.g. ``prefill_hosts: [...]`` is ``prefill: {hosts: [...]}``.
_FLAT_ROLE_KEYS = {
    flat: (role, key)
    for role in INSTANCE_ROLES
    for flat, key in ((f"num_{role}", "count"), (f"{role}_args", "args"), (f"{role}_hosts", "hosts"))
}


def topology_from_mapping(data: dict[str, Any], base: Topology | None = None) -> Topology:
    """Build a Topology from a YAML mapping; unknown keys are an error, not silently ignored.

    Accepted shape (every key optional)::

        model: /path/to/model
        prefill: {count: 2, args: ["--max-num-seqs", "64"], hosts: [10.0.0.2, 10.0.0.3]}
        decode: {count: 2}
        # or, instead of prefill and decode, an elastic pool (each instance takes any role per request):
        # elastic: {count: 3, args: [...], hosts: [...]}
        proxy_port: 8000
        vllm_args: ["--enforce-eager"]
        on_instance_exit: restart    # or stop
        ray: 10.0.0.2:6379           # on a Ray cluster, with per role: resources: {pdserve_prefill: 1}
    """
    base = base or Topology()
    data = _nest_flat_role_keys(data)
    values: dict[str, Any] = {
        role: _role_from_mapping(role, data[role], base.role(role)) for role in INSTANCE_ROLES if role in data
    }
    for key, value in data.items():
        if key in INSTANCE_ROLES:
            continue
        if key in _TOPOLOGY_FIELDS:
            values[key] = value
        else:
            allowed = sorted(_TOPOLOGY_FIELDS | set(INSTANCE_ROLES))
            raise ConfigError(f"unknown topology key {key!r}; valid keys: {', '.join(allowed)}")
    if "vllm_args" in values:
        values["vllm_args"] = _strings("topology.vllm_args", values["vllm_args"])
    try:
        return dataclasses.replace(base, **values)
    except TypeError as exc:
        raise ConfigError(f"invalid topology: {exc}") from exc


def _nest_flat_role_keys(data: dict[str, Any]) -> dict[str, Any]:
    nested = {k: v for k, v in data.items() if k not in _FLAT_ROLE_KEYS}
    for flat, (role, key) in _FLAT_ROLE_KEYS.items():
        if flat in data:
            mapping = nested.get(role, {})
            nested[role] = {key: data[flat], **mapping} if isinstance(mapping, dict) else mapping
    return nested


def _role_from_mapping(role: Role, value: object, base: RoleSpec) -> RoleSpec:
    if not isinstance(value, dict) or set(value) - _ROLE_KEYS:
        raise ConfigError(
            f"topology.{role} must be a mapping with 'count', 'args', 'hosts' and/or 'resources'"
        )
    values: dict[str, Any] = {k: v for k, v in value.items() if k == "count"}
    for key in _TUPLE_KEYS:
        if key in value:
            values[key] = _strings(f"topology.{role}.{key}", value[key])
    if "resources" in value:
        values["resources"] = resource_pairs(f"topology.{role}.resources", value["resources"])
    return dataclasses.replace(base, **values)


def _strings(where: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where} must be a list of strings")
    return tuple(str(v) for v in value)


def resource_pairs(where: str, value: object) -> Resources:
    """A YAML mapping of Ray resources ({pdserve_prefill: 1}) as a RoleSpec's sorted pairs."""
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
