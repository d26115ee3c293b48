"""A generation request served whole by one named instance: the reference a proof scores PD answers
against, asked through the proxy, where clients (and `pdserve verify`) may reach nothing else.

    X-Pdserve-Whole-On: decode-0 | elastic-1 | prefill-0 | http://host:port
    X-Pdserve-Admin-Key: <admin key>        (needed when the proxy has one)

The request takes no split, no prefill, no other instance on failure and no migration: its answer is
that one instance computing the prompt itself, or that instance's error. It is the admin's, not a
client's, because it steers load past the router and the circuit breakers. A proxy without an admin key
serves it to anyone, as it serves /requests.
"""

from __future__ import annotations

import hmac
from typing import Final

from pdserve.asgi import Scope
from pdserve.errors import UpstreamError, WholeOnRefused
from pdserve.proxy.attempt import Call, DecodeFailed, HandoffSlot, relay_rejection
from pdserve.proxy.decode import Decoder
from pdserve.proxy.instance import Instance
from pdserve.proxy.state import ProxyState

WHOLE_ON: Final = b"x-pdserve-whole-on"
ADMIN_KEY: Final = b"x-pdserve-admin-key"


def pool_names(state: ProxyState) -> dict[str, Instance]:
    """Each instance under the name /instances order and `pdserve up` give it ("decode-0", "elastic-1")."""
    if state.elastic is not None:
        return {f"elastic-{k}": instance for k, instance in enumerate(state.instances)}
    return {
        f"{role}-{k}": instance
        for role in ("prefill", "decode")
        for k, instance in enumerate(state.pool(role).instances)
    }


def asked_whole_on(scope: Scope, state: ProxyState, admin_key: str | None) -> Instance | None:
    """The instance the request names to serve it whole, or None for an ordinary request.
    ``WholeOnRefused`` when it names one without the admin key the proxy has, or one it does not know."""
    named = given_key = None
    for key, value in scope["headers"]:
        if key == WHOLE_ON:
            named = bytes(value).decode("latin-1").strip()
        elif key == ADMIN_KEY:
            given_key = bytes(value).decode("latin-1")
    if named is None:
        return None
    if admin_key is not None and not hmac.compare_digest((given_key or "").encode(), admin_key.encode()):
        raise WholeOnRefused(401, "X-Pdserve-Whole-On needs the admin key (X-Pdserve-Admin-Key)")
    names = pool_names(state)
    found = names.get(named) or state.find(named.rstrip("/"))
    if found is None:
        known = ", ".join(names) or "none"
        raise WholeOnRefused(404, f"X-Pdserve-Whole-On: no instance {named!r} (known: {known})")
    return found


async def serve_whole_on(decoder: Decoder, call: Call, slot: HandoffSlot, instance: Instance) -> None:
    """``instance`` computes the prompt and answers, alone: no router, no prefill, no other instance
    after a failure. A proof scores PD answers against exactly this instance's own computation, so a
    stand-in would prove nothing; its failure is the client's answer."""
    call.trace.local_prefill_reason = f"asked whole on {instance.url} (X-Pdserve-Whole-On)"
    call.trace.decode_url = instance.url
    decoded = await decoder.attempt(call, instance, slot, is_last=True)
    if not isinstance(decoded, DecodeFailed):
        return
    if isinstance(decoded.failure, UpstreamError):
        raise decoded.failure
    await relay_rejection("decode", instance.url, decoded.failure, call.out)
