"""What `pdserve doctor` found: checks per pair, the measured handoff, the verdict, and the exit status.

Exit status (for scripts; docs/cli.md says the same):

    0  every check passed and the split pays on this link (moving the KV is faster than computing it)
    1  a check failed: a mismatch, an unreachable side channel, a canary that moved no KV or answered wrong
    2  doctor could not run: the proxy did not answer or is not a pdserve proxy (cli.py: any PDServeError)
    3  everything works, but the split does not pay: moving the KV takes longer than computing it on decode
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pdserve.doctor.advice import Handoff, Verdict, duration, rate, size

EXIT_HEALTHY: Final = 0
EXIT_FAILED: Final = 1
EXIT_COULD_NOT_RUN: Final = 2
EXIT_DOES_NOT_PAY: Final = 3

Status = Literal["pass", "fail", "warn", "info"]
_MARK: Final[dict[Status, str]] = {"pass": "PASS", "fail": "FAIL", "warn": "WARN", "info": "    "}


@dataclass(frozen=True)
class Check:
    status: Status
    what: str  # one line a person reads; it names the instance and the numbers


@dataclass
class PairReport:
    prefill: str
    decode: str
    checks: list[Check] = field(default_factory=list)
    handoff: Handoff | None = None
    verdict: Verdict | None = None
    transport: str = "unknown"  # what is known of how the bytes moved (NIXL backend, UCX lanes)
    params: dict[str, Any] | None = None  # the kv_transfer_params prefill answered the canary with

    def add(self, status: Status, what: str) -> None:
        self.checks.append(Check(status, what))

    def check(self, ok: bool, what: str) -> bool:
        self.add("pass" if ok else "fail", what)
        return ok

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]


@dataclass
class DoctorReport:
    proxy: str
    model: str | None = None
    checks: list[Check] = field(default_factory=list)  # about the proxy, before any pair
    pairs: list[PairReport] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> bool:
        self.checks.append(Check("pass" if ok else "fail", what))
        return ok

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"] + [c for p in self.pairs for c in p.failures]

    @property
    def exit_code(self) -> int:
        if self.failures or not self.pairs:
            return EXIT_FAILED
        verdicts = [p.verdict for p in self.pairs]
        if any(v is None for v in verdicts):
            return EXIT_FAILED  # nothing measured is not a pass
        return EXIT_HEALTHY if all(v.pays for v in verdicts if v) else EXIT_DOES_NOT_PAY

    @property
    def summary(self) -> str:
        code = self.exit_code
        if code == EXIT_FAILED:
            first = self.failures[0].what if self.failures else "no prefill→decode pair to check"
            return f"FAILED ({len(self.failures)} check(s)); first: {first}"
        if code == EXIT_DOES_NOT_PAY:
            return "works, but disaggregation does not pay on this link (see the advice above)"
        return "healthy: every check passed and moving the KV is cheaper than computing it"

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["exit_code"] = self.exit_code
        out["summary"] = self.summary
        for pair, raw in zip(self.pairs, out["pairs"], strict=True):
            if pair.handoff is not None:
                raw["handoff"]["bandwidth_bytes_per_s"] = pair.handoff.bandwidth
                raw["handoff"]["bytes_per_token"] = pair.handoff.bytes_per_token
                raw["handoff"]["added_s"] = pair.handoff.added_s
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def _check_lines(checks: list[Check]) -> list[str]:
    return [f"  {_MARK[c.status]}  {c.what}" for c in checks]


def render(report: DoctorReport) -> list[str]:
    lines = [f"pdserve doctor {report.proxy}" + (f"  (model {report.model})" if report.model else "")]
    lines += _check_lines(report.checks)
    for pair in report.pairs:
        lines += ["", f"pair  prefill {pair.prefill}  →  decode {pair.decode}"]
        lines += _check_lines(pair.checks)
        lines.append(f"  transport: {pair.transport}")
        if pair.verdict is not None:
            lines += ["", *(f"  {line}" for line in pair.verdict.lines)]
    lines += ["", f"doctor: {report.summary}"]
    return lines


def brief(report: DoctorReport) -> list[str]:
    """A few lines for the end of `pdserve up`: per pair, its rate and verdict, or its first failure."""
    lines = []
    for pair in report.pairs:
        head = f"doctor {pair.prefill} → {pair.decode}: "
        if pair.failures:
            lines.append(head + f"FAIL {pair.failures[0].what}")
        elif pair.handoff is not None and pair.verdict is not None:
            h, v = pair.handoff, pair.verdict
            lines.append(
                head + f"KV {size(v.one_bytes)} moved at {rate(v.bandwidth)} in "
                f"{duration(v.move_s)}; prefilling it here takes {duration(h.local_prefill_s)}: "
                + (
                    "the link is fast enough for the split"
                    if v.pays
                    else "the split costs more than it saves"
                )
            )
    for check in report.checks:
        if check.status == "fail":
            lines.append(f"doctor: FAIL {check.what}")
    if report.exit_code != EXIT_HEALTHY:
        lines.append(f"doctor: {report.summary}; `pdserve doctor {report.proxy}` says more")
    return lines
