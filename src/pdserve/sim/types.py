"""Messages between the simulator's engine core (``engine.py``) and its HTTP layer (``api.py``).

The core knows tokens, blocks and time; the HTTP layer knows JSON, SSE and the NixlConnector fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

SimRole = Literal["prefill", "decode", "both"]
FinishReason = Literal["length", "stop", "abort", "error"]


@dataclass(frozen=True)
class RemoteKV:
    """Where a decode request's KV lives: the summary of prefill's kv_transfer_params."""

    engine_id: str  # the prefill engine's id (remote_engine_id)
    request_id: str  # the prefill request's id (remote_request_id)
    block_ids: tuple[int, ...]
    num_tokens: int  # prompt tokens whose KV prefill holds
    host: str
    port: int  # where the holder can be asked to serve the pull (the sim's HTTP port)
    prompt_digest: int = 0  # hash of decode's own prompt ids: KV held for another prompt is wrong KV
    tp_size: int = 1  # prefill's tensor-parallel size (tp_size), which decode must be able to pair with


@dataclass(frozen=True)
class HeldKV:
    """What a finished prefill request left behind for a remote decoder, under a lease."""

    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float  # engine clock (seconds); decode heartbeats push it back
    num_cached_tokens: int  # prompt tokens that were prefix-cache hits
    # False for a read of blocks the holder had already released (lease run out, or read before): like
    # vLLM's one-sided NIXL READ it "succeeds", but the blocks hold whatever was put there since.
    is_intact: bool = True
    prompt_digest: int = 0  # hash of the prompt ids whose KV this is (0: unknown)


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    hold_for_remote: bool = False  # prefill side of PD (do_remote_decode): keep the KV under a lease
    remote: RemoteKV | None = None  # decode side of PD (do_remote_prefill): pull this KV first
    seed: int = 0  # output tokens are a deterministic function of (seed, prompt, position)
    cache_salt: str | None = None  # hashed into the first block, as vLLM does: no prefix shared across salts
    logprobs: bool = False  # report each output token's logprob (sim/logprobs.py)


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    index: int  # 0-based output position
    finish_reason: FinishReason | None = None  # set on the request's last event
    num_cached_tokens: int = 0  # on the first event: prompt tokens served from the prefix cache
    held: HeldKV | None = None  # on the last event of a hold_for_remote request
    logprob: float | None = None  # the token's logprob, when the request asked for logprobs


class KVSource(Protocol):
    """How a decode engine reaches prefill's KV; provided by the HTTP layer (in-process or over HTTP)."""

    async def pull(self, remote: RemoteKV) -> bool:
        """Read the blocks; True if they still held this request's KV, False if the holder had released
        them (the read still "succeeds", as vLLM's does). KVPullError if the read fails (holder gone,
        restarted under a new engine id, an injected fault)."""
        ...

    def heartbeat(self, engine_id: str, host: str, port: int, request_ids: tuple[str, ...]) -> None:
        """Ask the holder to extend these requests' leases; fire and forget, as vLLM's NIXL notif is."""
        ...
