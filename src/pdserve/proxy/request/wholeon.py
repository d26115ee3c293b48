"""A generation request served whole by one named instance: the reference a proof scores PD answers
against, asked through the proxy, where clients (and `pdserve verify`) may reach nothing else.

    X-Pdserve-Whole-On: decode-0 | elastic-1 | prefill-0 | http://host:port
    X-Pdserve-Admin-Key: <admin key>        (needed when the proxy has one)

The request takes no split, no prefill, no other instance on failure and no migration: its answer is
that one instance computing the prompt itself, or that instance's error (the plan's ``whole_on``). It is the admin's, not a
client's, because it steers load past the router and the circuit breakers. A proxy without an admin key
serves it to anyone, as it serves /requests.
"""

from __future__ import annotations

import hmac
from typing import Final

from pdserve.asgi import Scope, header
from pdserve.errors import WholeOnRefused
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.state import ProxyState

WHOLE_ON: Final = b"x-pdserve-whole-on"
ADMIN_KEY: Final = b"x-pdserve-admin-key"


def asked_whole_on(named: str, scope: Scope, state: ProxyState, admin_key: str | None) -> Instance:
    """The instance ``named`` (the request's X-Pdserve-Whole-On) to serve the request whole.
    ``WholeOnRefused`` without the admin key the proxy has, or for an instance it does not know."""
    if admin_key is not None:
        given_key = header(scope, ADMIN_KEY) or ""
        if not hmac.compare_digest(given_key.encode(), admin_key.encode()):
            raise WholeOnRefused(401, "X-Pdserve-Whole-On needs the admin key (X-Pdserve-Admin-Key)")
    named = named.strip()
    names = state.by_name()
    found = names.get(named) or state.find(named.rstrip("/"))
    if found is None:
        known = ", ".join(names) or "none"
        raise WholeOnRefused(404, f"X-Pdserve-Whole-On: no instance {named!r} (known: {known})")
    return found
