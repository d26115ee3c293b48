"""Network namespaces as stand-in hosts: each gets its own address on one bridge and nothing else.

A namespace sees only its own loopback and its veth end, so a process there that dials 127.0.0.1
reaches its own namespace, never another "host": anything that silently relies on loopback between
prefill and decode fails here instead of passing. Needs root (``ip netns``, ``ip link``), as CI has.

Names carry the test process's pid (``pdsv-<pid>-<name>``, interfaces ``pb<pid>``/``pv<pid>i``) so
runs side by side do not collide, and ``Network.close`` removes everything it made, even half-made.
"""

from __future__ import annotations

import abc
import ipaddress
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

_IP = "ip"
_INNER_LINK = "pdsv0"  # the veth end inside a namespace: one per namespace, so the name may repeat
_SUBNET_POOL = ipaddress.ip_network("10.213.0.0/16")  # /24s from here; none is routed on CI hosts


def _ip(*args: str, netns: str | None = None) -> str:
    command = [_IP, *args] if netns is None else [_IP, "netns", "exec", netns, _IP, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def can_make_namespaces() -> str | None:
    """Why this process cannot build namespaces, or None when it can."""
    if os.geteuid() != 0:
        return f"network namespaces need root; running as uid {os.geteuid()}"
    try:
        _ip("netns", "list")
    except (OSError, RuntimeError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


@dataclass(frozen=True)
class Host:
    """One namespace on the bridge."""

    namespace: str
    address: str  # its only non-loopback address
    link: str = _INNER_LINK

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """Prepend to a command to run it inside this namespace (the same pid: ``ip`` execs it)."""
        return (_IP, "netns", "exec", self.namespace)

    def addresses(self) -> list[str]:
        """Every IPv4 address the namespace has, loopback included."""
        out = _ip("-4", "-o", "addr", "show", netns=self.namespace)
        return [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]


class Resource(abc.ABC):
    """What a test builds and must take down again (a network, a Ray cluster on it): ``open`` builds it,
    ``close`` takes down whatever of it exists. As a context manager, a failed ``open`` is closed too, so
    half of one never outlives the test."""

    @abc.abstractmethod
    def open(self) -> object: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Network(Resource):
    """A bridge in the root namespace (the proxy's "host", at ``gateway``) and one namespace per name.

    Use as a context manager; ``close`` is idempotent and tolerates a half-built network.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._pid = os.getpid()
        self.bridge = f"pb{self._pid}"
        self._names = tuple(names)
        self._namespaces: list[str] = []
        self._has_bridge = False
        self.subnet = _free_subnet(self._pid)
        self.gateway = str(self.subnet.network_address + 1)
        self.hosts: dict[str, Host] = {}

    def open(self) -> Network:
        prefix = self.subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        self._has_bridge = True
        _ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self._names):
            namespace = f"pdsv-{self._pid}-{name}"
            outer = f"pv{self._pid}{i}"
            _ip("netns", "add", namespace)
            self._namespaces.append(namespace)
            # Created with its peer already inside the namespace: deleting the namespace deletes both.
            _ip("link", "add", outer, "type", "veth", "peer", "name", _INNER_LINK, "netns", namespace)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            address = str(self.subnet.network_address + 2 + i)
            _ip("addr", "add", f"{address}/{prefix}", "dev", _INNER_LINK, netns=namespace)
            _ip("link", "set", _INNER_LINK, "up", netns=namespace)
            # vLLM's API server and engine core talk over loopback inside one instance.
            _ip("link", "set", "lo", "up", netns=namespace)
            self.hosts[name] = Host(namespace, address)
        return self

    def close(self) -> None:
        errors = []
        for namespace in reversed(self._namespaces):
            try:
                _ip("netns", "delete", namespace)
            except (OSError, RuntimeError) as exc:
                errors.append(str(exc))
        self._namespaces.clear()
        if self._has_bridge:
            try:
                _ip("link", "delete", self.bridge)
            except (OSError, RuntimeError) as exc:
                errors.append(str(exc))
            self._has_bridge = False
        if errors:
            raise RuntimeError("cleaning up the test network: " + "; ".join(errors))


def _free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 of the pool that no address of this host's root namespace is in, starting at one the pid picks."""
    taken = _ip("-4", "-o", "addr", "show")
    used = {
        ipaddress.ip_interface(line.split()[3]).ip for line in taken.splitlines() if len(line.split()) > 3
    }
    subnets = list(_SUBNET_POOL.subnets(new_prefix=24))
    for step in range(len(subnets)):
        candidate = subnets[(pid + step) % len(subnets)]
        if not any(address in candidate for address in used):
            return candidate
    raise RuntimeError(f"no free /24 left in {_SUBNET_POOL}")
