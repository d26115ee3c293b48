"""Which model an instance serves (its ``/v1/models``): prefill and decode must serve the same one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import orjson

from pdserve.errors import ConfigError, UpstreamError
from pdserve.proxy.pool.instance import Instance


async def model_ids(instance: Instance, timeout: float) -> set[str]:
    """The model ids the instance serves; empty when it does not answer (it may still be starting)."""
    try:
        reply = await instance.upstream.get("/v1/models", "models", timeout)
        return {m["id"] for m in orjson.loads(reply.body)["data"]} if reply.status == 200 else set()
    except (UpstreamError, orjson.JSONDecodeError, KeyError, TypeError):
        return set()


async def models_in_service(pools: Iterable[Sequence[Instance]], timeout: float) -> set[str]:
    """What the pools serve, as a newcomer must (the admin API, discovery): the first instance of each
    tells, since every instance of a pool serves one model. Empty when none answers."""
    served: set[str] = set()
    for instances in pools:
        for existing in instances[:1]:
            served |= await model_ids(existing, timeout)
    return served


async def check_models_match(prefill: Iterable[Instance], decode: Iterable[Instance], timeout: float) -> None:
    """ConfigError when the prefill and the decode instances that answer serve no model in common."""
    served = {i.url: await model_ids(i, timeout) for i in (*prefill, *decode)}
    by_role: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for role, instances in (("prefill", prefill), ("decode", decode)):
        for instance in instances:
            by_role[role] |= served[instance.url]
    if by_role["prefill"] and by_role["decode"] and not by_role["prefill"] & by_role["decode"]:
        detail = "; ".join(f"{url} serves {sorted(ids)}" for url, ids in served.items() if ids)
        raise ConfigError(f"prefill and decode instances serve different models: {detail}")
