"""The addresses instances are reached and advertised at, and the checks that keep them dialable.

vLLM binds an instance's NIXL side channel to ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and hands the very same
string to decode as the address to dial (docs/deploying.md). So an address pdserve gives an instance
must be one its peers can reach: never a wildcard, which decode would take as itself, and never loopback
while a peer sits at another address, which reaches only the peer's own host (or network namespace).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from pdserve.errors import ConfigError

_HOST_LABEL = r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_HOST_LABEL}(\.{_HOST_LABEL})*")
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
LOCAL_FALLBACK = "127.0.0.1"  # where a wildcard bind is reached and advertised on one host


def is_host(text: str) -> bool:
    """An IP address or a DNS host name: what a peer can dial (no scheme, port or spaces)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return bool(_HOST_NAME.fullmatch(text))
    return True


def is_wildcard(host: str) -> bool:
    return host in _WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether ``host`` names loopback, of which each host (and each network namespace) has its own."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def reachable(host: str) -> str:
    """The address a peer on this host dials for an instance bound at ``host``."""
    return LOCAL_FALLBACK if is_wildcard(host) else host


def check_addresses(
    host: str, roles: Sequence[tuple[str, tuple[str, ...], int]], instance_hosts: Sequence[str]
) -> None:
    """ConfigError unless every instance has one dialable address: ``roles`` is (role, its own
    addresses, its instance count) each, ``instance_hosts`` what every instance ends up at."""
    for role, hosts, count in roles:
        if hosts and len(hosts) != count:
            raise ConfigError(
                f"topology.{role}.hosts names {len(hosts)} address(es) for {count} {role} instance(s): "
                "give one per instance, or none to put them all at topology.host"
            )
        for address in hosts:
            if not is_host(address) or is_wildcard(address):
                raise ConfigError(
                    f"topology.{role}.hosts: {address!r} is not an address a peer can dial (an IP or host "
                    "name of that instance; not 0.0.0.0 or ::, which decode would take as itself)"
                )
    if not is_host(host) and not is_wildcard(host):
        raise ConfigError(f"topology.host {host!r} is not an IP address or host name")
    loopback = {h for h in instance_hosts if is_loopback(h)}
    others = set(instance_hosts) - loopback
    if loopback and others:
        raise ConfigError(
            f"topology mixes loopback ({', '.join(sorted(loopback))}) and other instance addresses "
            f"({', '.join(sorted(others))}): an instance on another host cannot reach a loopback address; "
            "give every instance an address its peers can dial"
        )
