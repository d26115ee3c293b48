"""Continuous batching for one simulated engine: pure logic, no asyncio, no clock, no tensors.

The engine calls ``schedule()`` for a step's plan, lets the step's time pass, then ``update(plan, now)``
for the tokens the step produced. A plan serves decoding sequences first (one token each), then prefill
chunks of running sequences, then admits waiting requests FCFS while blocks, sequence slots and the token
budget last. Blocks for a request's whole known sequence are taken at admission, so only decoding grows a
table; when it cannot, the most recently admitted running request is preempted and later recomputed.

PD roles: a ``hold_for_remote`` request finishes after its first token and leaves its blocks held under a
lease for a remote decoder; a ``remote`` request gets blocks for its prompt, waits while the engine pulls
the KV, then computes only what was not pulled (normally just the last prompt token). A pull of blocks
the holder had already released (or held for another prompt) fills them with someone else's KV: that
request's output and logprobs, and those of later requests finding the blocks in the prefix cache, are wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.sim import logprobs
from pdserve.sim.kvcache import KVCache
from pdserve.sim.logprobs import FIRST_TOKEN_ID as FIRST_TOKEN_ID  # where callers have long found it
from pdserve.sim.logprobs import output_token
from pdserve.sim.profile import Profile
from pdserve.sim.types import FinishReason, HeldKV, RemoteKV, SimRequest, SimRole, TokenEvent

NO_TOKEN = -1  # token_id of an "error" event: the request ended without producing a token
_STALE_SALT = 0x5851F42D4C957F2D  # what a sequence computed from stale KV mixes into its prompt hash


class Status(enum.Enum):
    WAITING = "waiting"
    PULLING = "pulling"  # blocks allocated, remote KV being pulled into them
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request: SimRequest
    token_ids: list[int]  # prompt, then outputs
    num_prompt_tokens: int
    prompt_hash: int
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks of token_ids
    num_computed_tokens: int = 0  # tokens whose KV is in this engine's blocks
    num_cached_tokens: int = -1  # reported on the first token; set at first admission
    status: Status = Status.WAITING
    is_pull_pending: bool = False  # a remote request not yet pulled (recomputed locally if preempted after)
    reads_stale_kv: bool = False  # some of its KV came from released blocks: its outputs are wrong
    arrived_at: float = 0.0  # when the scheduler was given it (engine clock)
    context_digest: int = 0  # of every token so far, for logprobs (computed only when asked for)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        num_tokens = len(self.token_ids)
        return self.num_computed_tokens == num_tokens - 1 and num_tokens > self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class PullJob:
    request_id: str
    remote: RemoteKV
    num_blocks: int  # blocks to fill from the remote (the prompt's blocks not in the local prefix cache)


@dataclass(slots=True)
class StepPlan:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    pulls: list[PullJob] = field(default_factory=list)  # admitted this step; the engine starts the pulls
    num_prefill_tokens: int = 0
    num_decode_ctx_tokens: int = 0  # the decoding sequences' context lengths, summed

    @property
    def has_compute(self) -> bool:
        return bool(self.decodes or self.prefills)


StepOutput = tuple[str, TokenEvent]  # (request id, event)


class Scheduler:
    def __init__(self, profile: Profile, role: SimRole, vocab_size: int = 1000) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.profile = profile
        self.role = role
        self.vocab_size = vocab_size
        self.kv = KVCache(profile.num_blocks, profile.block_size)
        self.waiting: deque[Sequence] = deque()  # aborted entries are skipped lazily
        self.running: list[Sequence] = []  # in admission order; finished entries dropped at schedule()
        self.pulling: dict[str, Sequence] = {}
        self.held: dict[str, HeldKV] = {}  # heartbeats move expiries, so not in expiry order
        self._live: dict[str, Sequence] = {}
        self._num_in: Counter[Status] = Counter()
        self.num_preemptions = 0
        self.num_kv_expired = 0
        self.num_stale_reads = 0  # requests computed on stale KV (pulled late, or a stale prefix hit)
        self.prompt_tokens_computed = 0  # prefill tokens actually computed, recomputation included
        self.prompt_tokens_cached = 0  # served by the local prefix cache at admission
        self.prompt_tokens_remote = 0  # filled by pulls from a prefill engine
        self.generation_tokens = 0

    # --- Requests in and out -------------------------------------------------------------------------

    def check_request(self, req: SimRequest) -> None:
        """Raise ValueError, worded like vLLM's 400s where vLLM has one, if ``req`` cannot be served."""
        num_prompt, profile = len(req.prompt_token_ids), self.profile
        if num_prompt == 0:
            raise ValueError("The decoder prompt cannot be empty")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}.")
        if num_prompt + req.max_tokens > profile.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {profile.max_model_len} tokens. However, you "
                f"requested {num_prompt + req.max_tokens} tokens ({num_prompt} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the messages or completion."
            )
        num_blocks = -(-(num_prompt + req.max_tokens) // profile.block_size)
        if num_blocks > profile.num_blocks:
            raise ValueError(f"request needs {num_blocks} KV blocks; the pool has {profile.num_blocks}")
        if req.hold_for_remote and req.remote is not None:
            raise ValueError("a request cannot both hold KV for a remote decode and pull remote KV")
        if req.hold_for_remote and self.role == "decode":
            raise ValueError("a decode engine does not hold KV for remote decode (do_remote_decode)")
        if req.remote is not None and self.role == "prefill":
            raise ValueError("a prefill engine does not pull remote KV (do_remote_prefill)")
        if req.request_id in self._live or req.request_id in self.held:
            raise ValueError(f"request id {req.request_id!r} is already in use")

    def add_request(self, req: SimRequest, now: float = 0.0) -> Sequence:
        self.check_request(req)
        tokens = list(req.prompt_token_ids)
        seq = Sequence(
            req,
            tokens,
            len(tokens),
            hash(req.prompt_token_ids),
            is_pull_pending=req.remote is not None,
            arrived_at=now,
            context_digest=logprobs.digest_of(tokens) if req.logprobs else 0,
        )
        self.kv.hash_blocks(tokens, seq.block_hashes, req.cache_salt)
        self._live[req.request_id] = seq
        self.waiting.append(seq)
        self._num_in[Status.WAITING] += 1
        return seq

    def abort(self, request_id: str) -> bool:
        """Finish a live request at once and free its blocks; False if it is not live (held KV is not)."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._finish(seq)
        return True

    def release_held(self, request_id: str) -> HeldKV | None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.kv.free(request_id)
        return held

    def expire_held(self, now: float) -> list[str]:
        expired = [request_id for request_id, held in self.held.items() if held.expires_at <= now]
        for request_id in expired:
            self.release_held(request_id)
        self.num_kv_expired += len(expired)
        return expired

    def extend_held(self, request_ids: Iterable[str], until: float) -> None:
        """A decode heartbeat: these requests' leases run at least until ``until`` (ids no longer held
        are ignored, as vLLM ignores them)."""
        for request_id in request_ids:
            held = self.held.get(request_id)
            if held is not None and held.expires_at < until:
                self.held[request_id] = dataclasses.replace(held, expires_at=until)

    def next_expiry(self) -> float | None:
        return min(held.expires_at for held in self.held.values()) if self.held else None

    def mark_pulled(self, request_id: str, is_intact: bool = True) -> bool:
        """The remote KV is in this engine's blocks: compute the rest (normally the last prompt token).

        ``is_intact`` False: the holder had released them, so what arrived is someone else's KV."""
        seq = self.pulling.pop(request_id, None)
        if seq is None:
            return False
        remote = seq.request.remote
        assert remote is not None
        num_computed = max(seq.num_computed_tokens, min(remote.num_tokens, seq.num_prompt_tokens - 1))
        if not is_intact:
            self.kv.mark_stale(request_id, seq.num_computed_tokens, num_computed)
            self._read_stale(seq)
        self.prompt_tokens_remote += num_computed - seq.num_computed_tokens
        # vLLM reports every prompt token the connector loaded as cached, the recomputed last one too.
        seq.num_computed_tokens = num_computed
        seq.num_cached_tokens = max(num_computed, min(remote.num_tokens, seq.num_prompt_tokens))
        seq.is_pull_pending = False
        self.kv.cache_blocks(request_id, seq.block_hashes, num_computed)
        self._set_status(seq, Status.RUNNING)
        self.running.append(seq)
        return True

    def mark_pull_failed(self, request_id: str) -> StepOutput | None:
        seq = self.pulling.get(request_id)
        if seq is None:
            return None
        self._finish(seq)
        return request_id, TokenEvent(NO_TOKEN, seq.num_output_tokens, "error")

    # --- Steps ---------------------------------------------------------------------------------------

    def schedule(self, admit_until: float = math.inf) -> StepPlan:
        """The next step's plan; only requests that arrived by ``admit_until`` are admitted (vLLM's async
        scheduling plans a step while the one before it runs: what arrives meanwhile waits a step more)."""
        plan = StepPlan()
        budget = self.profile.max_num_batched_tokens
        kv = self.kv
        running = self.running = [s for s in self.running if s.status is Status.RUNNING]
        num_preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if not seq.is_decoding:
                i += 1
                continue
            num_tokens = len(seq.token_ids)
            if kv.num_slots(seq.request_id) < num_tokens:  # its last block is full: grow or preempt
                while not kv.can_allocate(num_tokens, seq.request_id):
                    victim = running.pop()
                    self._preempt(victim)
                    num_preempted += 1
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    break
                kv.allocate(seq.request_id, num_tokens)
            plan.decodes.append(seq)
            plan.num_decode_ctx_tokens += num_tokens
            budget -= 1
            i += 1
        for seq in running:
            if budget == 0:
                break
            if not seq.is_decoding:
                budget -= self._add_chunk(plan, seq, budget)
        if num_preempted == 0:  # as vLLM: freshly preempted requests must not be readmitted at once
            self._admit(plan, budget, admit_until)
        return plan

    def _admit(self, plan: StepPlan, budget: int, admit_until: float) -> None:
        kv, waiting = self.kv, self.waiting
        while waiting and len(self.running) + len(self.pulling) < self.profile.max_num_seqs:
            seq = waiting[0]
            if seq.status is not Status.WAITING:
                waiting.popleft()
                continue
            if (budget == 0 and not seq.is_pull_pending) or seq.arrived_at > admit_until:
                break
            hits = kv.lookup(seq.block_hashes, seq.num_tokens)
            if not kv.can_allocate(seq.num_tokens, seq.request_id, hits):
                break  # FCFS: nobody overtakes the head of the queue
            waiting.popleft()
            if kv.has_stale(hits):
                self._read_stale(seq)
            blocks = kv.allocate(seq.request_id, seq.num_tokens, hits)
            num_hit_tokens = len(hits) * kv.block_size
            kv.record_query(seq.num_tokens, num_hit_tokens)
            self.prompt_tokens_cached += num_hit_tokens
            seq.num_computed_tokens = num_hit_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit_tokens
            if seq.is_pull_pending:
                assert seq.request.remote is not None
                plan.pulls.append(PullJob(seq.request_id, seq.request.remote, len(blocks) - len(hits)))
                self.pulling[seq.request_id] = seq
                self._set_status(seq, Status.PULLING)
                continue
            self._set_status(seq, Status.RUNNING)
            self.running.append(seq)
            budget -= self._add_chunk(plan, seq, budget)

    @staticmethod
    def _add_chunk(plan: StepPlan, seq: Sequence, budget: int) -> int:
        num = min(seq.num_tokens - seq.num_computed_tokens, budget)
        plan.prefills.append((seq, num))
        plan.num_prefill_tokens += num
        return num

    def update(self, plan: StepPlan, now: float) -> list[StepOutput]:
        """Apply a finished step: advance each sequence and return the tokens it produced."""
        outputs: list[StepOutput] = []
        kv = self.kv
        block_size = kv.block_size
        for seq in plan.decodes:
            if seq.status is Status.RUNNING:  # else aborted during the step
                seq.num_computed_tokens += 1
                if seq.num_computed_tokens % block_size == 0:
                    kv.cache_blocks(seq.request_id, seq.block_hashes, seq.num_computed_tokens)
                outputs.append(self._emit(seq, now))
        for seq, num in plan.prefills:
            if seq.status is Status.RUNNING:
                seq.num_computed_tokens += num
                self.prompt_tokens_computed += num
                kv.cache_blocks(seq.request_id, seq.block_hashes, seq.num_computed_tokens)
                if seq.num_computed_tokens == len(seq.token_ids):
                    outputs.append(self._emit(seq, now))
        return outputs

    def _emit(self, seq: Sequence, now: float) -> StepOutput:
        req = seq.request
        index = seq.num_output_tokens
        token = output_token(req.seed, seq.prompt_hash, index, self.vocab_size)
        token_logprob, seq.context_digest = logprobs.step(seq.context_digest, token, req.logprobs)
        seq.token_ids.append(token)
        if len(seq.token_ids) % self.kv.block_size == 0:
            self.kv.hash_blocks(seq.token_ids, seq.block_hashes, seq.request.cache_salt)
        self.generation_tokens += 1
        num_cached = seq.num_cached_tokens if index == 0 else 0
        finish: FinishReason | None = None
        held: HeldKV | None = None
        if req.hold_for_remote:
            finish = "length"
            held = HeldKV(
                tuple(self.kv.blocks(req.request_id)), seq.num_prompt_tokens, now + self.profile.kv_lease_s,
                seq.num_cached_tokens, prompt_digest=hash(req.prompt_token_ids),
            )  # fmt: skip
            self._finish(seq, keep_blocks=True)
            self.held[req.request_id] = held
        elif index + 1 >= req.max_tokens:
            finish = "length"
            self._finish(seq)
        return req.request_id, TokenEvent(token, index, finish, num_cached, held, token_logprob)

    # --- State changes -------------------------------------------------------------------------------

    def _read_stale(self, seq: Sequence) -> None:
        if not seq.reads_stale_kv:
            seq.reads_stale_kv = True
            seq.prompt_hash ^= _STALE_SALT
            seq.context_digest ^= logprobs.WRONG_KV
            self.num_stale_reads += 1

    def _set_status(self, seq: Sequence, status: Status) -> None:
        self._num_in[seq.status] -= 1
        self._num_in[status] += 1
        seq.status = status

    def _finish(self, seq: Sequence, keep_blocks: bool = False) -> None:
        if seq.status is Status.PULLING:
            del self.pulling[seq.request_id]
        self._set_status(seq, Status.FINISHED)
        del self._live[seq.request_id]
        if not keep_blocks:
            self.kv.free(seq.request_id)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        self._set_status(seq, Status.WAITING)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # --- Reading -------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self._num_in[Status.RUNNING]

    @property
    def num_waiting(self) -> int:
        """Queued or pulling, as vLLM counts requests waiting for remote KV among the waiting."""
        return self._num_in[Status.WAITING] + self._num_in[Status.PULLING]

    @property
    def has_work(self) -> bool:
        return self._num_in[Status.RUNNING] > 0 or self._num_in[Status.WAITING] > 0
