"""The seed's go/no-go rule for disaggregation, applied to a compare sweep.

Disaggregate only if all three hold:
  1. the collocated baseline's p99 ITL misses its target (the ITL/TPOT SLO) at some swept rate
     ("if your p99 inter-token latency already meets its target collocated, the split costs you an extra
     deployment role and a transfer path for no gain");
  2. the KV transfer check passes (transfers happened, none failed, mean time under the limit);
  3. goodput improves over the baseline at every rate where the baseline misses its ITL target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.bench.summary import RunSummary, rate_label
from pdserve.bench.transfer import TransferCheck

RULE = (
    "Disaggregate only if (1) the collocated p99 ITL misses its target, (2) the KV transfer check passes, "
    "and (3) goodput improves. If the collocated p99 ITL already meets its target, the split costs an extra "
    "deployment role and a transfer path for no gain (disaggregation does not improve throughput)."
)

GO = "GO"
NO_GO = "NO-GO"
GO_UNCHECKED = "GO, pending the transfer check"
UNDETERMINED = "UNDETERMINED"


@dataclass
class RateCheck:
    rate: float
    baseline_itl_p99: float
    baseline_misses: bool
    baseline_goodput: float
    candidate_goodput: float
    improves: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "rate": rate_label(self.rate),
            "baseline_p99_itl_ms": None if math.isnan(self.baseline_itl_p99) else self.baseline_itl_p99,
            "baseline_misses_itl_target": self.baseline_misses,
            "baseline_goodput": None if math.isnan(self.baseline_goodput) else self.baseline_goodput,
            "candidate_goodput": None if math.isnan(self.candidate_goodput) else self.candidate_goodput,
            "goodput_improves": self.improves,
        }


@dataclass
class Verdict:
    baseline: str
    candidate: str
    decision: str
    itl_slo_ms: float | None
    reasons: list[str] = field(default_factory=list)
    checks: list[RateCheck] = field(default_factory=list)
    transfer: TransferCheck | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "baseline": self.baseline,
            "candidate": self.candidate,
            "decision": self.decision,
            "itl_slo_ms": self.itl_slo_ms,
            "reasons": list(self.reasons),
            "checks": [c.to_dict() for c in self.checks],
            "transfer": self.transfer.to_dict() if self.transfer else None,
        }


def _goodput(run: RunSummary | None) -> float:
    if run is None or run.error is not None:
        return 0.0
    return 0.0 if math.isnan(run.goodput) else run.goodput


def decide(
    baseline: str,
    candidate: str,
    runs: Sequence[RunSummary],
    itl_slo_ms: float | None,
    transfer: TransferCheck,
    min_gain: float = 0.0,
) -> Verdict:
    """Apply the rule to `candidate` against `baseline` over every rate swept."""
    by_key = {(r.target, r.rate): r for r in runs}
    rates = sorted({r.rate for r in runs if r.target in (baseline, candidate)})
    verdict = Verdict(baseline, candidate, UNDETERMINED, itl_slo_ms, transfer=transfer)
    if itl_slo_ms is None:
        verdict.reasons.append("no ITL target: pass --itl-slo MS or --goodput tpot:MS")
        return verdict
    for rate in rates:
        base = by_key.get((baseline, rate))
        cand = by_key.get((candidate, rate))
        base_itl = base.itl_p99 if base is not None and base.ok else math.nan
        # A baseline that completed nothing at this rate cannot be meeting its target.
        misses = math.isnan(base_itl) or base_itl > itl_slo_ms
        bg, cg = _goodput(base), _goodput(cand)
        improves = cg > bg * (1.0 + min_gain) and cg > 0.0
        verdict.checks.append(RateCheck(rate, base_itl, misses, bg, cg, improves))
    miss = [c for c in verdict.checks if c.baseline_misses]
    if not verdict.checks:
        verdict.reasons.append("no runs to judge")
        return verdict
    for name in (baseline, candidate):
        if not any(r.ok for r in runs if r.target == name):
            verdict.reasons.append(f"{name} completed no request at any rate: nothing to compare")
            return verdict
    if not miss:
        verdict.decision = NO_GO
        verdict.reasons.append(
            f"(1) fails: {baseline} p99 ITL meets the {itl_slo_ms:g} ms target at every swept rate; "
            "the split would cost an extra role and a transfer path for no gain"
        )
    else:
        verdict.reasons.append(
            f"(1) holds: {baseline} p99 ITL misses the {itl_slo_ms:g} ms target at rate(s) "
            + ", ".join(rate_label(c.rate) for c in miss)
        )
    if transfer.status == "fail":
        verdict.reasons.append(f"(2) fails: transfer check: {transfer.detail}")
    elif transfer.status == "pass":
        verdict.reasons.append(f"(2) holds: transfer check: {transfer.detail}")
    else:
        verdict.reasons.append(f"(2) not checked: {transfer.detail}")
    judged = miss or verdict.checks
    worse = [c for c in judged if not c.improves]
    gain_text = f" by more than {100 * min_gain:g}%" if min_gain > 0 else ""
    if worse:
        verdict.reasons.append(
            f"(3) fails: {candidate} goodput does not improve{gain_text} at rate(s) "
            + ", ".join(
                f"{rate_label(c.rate)} ({c.candidate_goodput:.3f} vs {c.baseline_goodput:.3f} req/s)"
                for c in worse
            )
        )
    else:
        verdict.reasons.append(
            f"(3) holds: {candidate} goodput improves{gain_text} at rate(s) "
            + ", ".join(
                f"{rate_label(c.rate)} ({c.candidate_goodput:.3f} vs {c.baseline_goodput:.3f} req/s)"
                for c in judged
            )
        )
    if not miss or transfer.status == "fail" or worse:
        verdict.decision = NO_GO
    elif transfer.status == "pass":
        verdict.decision = GO
    else:
        verdict.decision = GO_UNCHECKED
    return verdict


UNEQUAL = "unequal resources"


def note_resources(verdict: Verdict, baseline_text: str, candidate_text: str, problem: str | None) -> None:
    """Say first what each side ran on (pdserve.bench.resources); an unequal pair (run anyway, on request)
    gets the problem as a reason and its decision marked, so no one reads it as a like-for-like result."""
    lines = [f"resources: {verdict.baseline} {baseline_text}; {verdict.candidate} {candidate_text}"]
    if problem:
        lines.append(f"UNEQUAL RESOURCES ({problem}): this is not a like-for-like comparison")
        verdict.decision = f"{verdict.decision} ({UNEQUAL})"
    verdict.reasons[:0] = lines
