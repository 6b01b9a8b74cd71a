"""The starting P:D ratio from the workload and measured per-instance throughputs (the seed's rule 3).

A request costs a prefill instance ISL / prefill_tps seconds (ISL tokens at that instance's prefill rate)
and a decode instance OSL / decode_tps seconds (OSL tokens at the decode rate one instance sustains, in
aggregate over the batch it runs within the ITL target). In steady state both pools must keep up with the
same request rate, so the balanced ratio is

    P : D = (ISL / prefill_tps) : (OSL / decode_tps)

and P prefill plus D decode instances sustain min(P x prefill_tps / ISL, D x decode_tps / OSL) requests/s.
For a given number of instances the split maximising that rate is chosen; without one, the smallest
split within 5 % of the balanced rate per instance (at most 16 instances).

Both throughputs must be measured on the hardware and at the workload's lengths (`pdserve bench` against
one instance: prefill tokens/s with max_tokens=1 at saturation; decode output tokens/s at the concurrency
that keeps ITL within its SLO), because they are not constants: the seed's two examples (32k in / 400 out
wants 3:2, 4k in / 8k out wants 1:3) imply a prefill instance 53x faster than a decode one in the first
and 1.5x in the second. A long-context decode batch is limited by KV memory, so its tokens/s falls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_AUTO_INSTANCES = 16
EFFICIENCY_GOAL = 0.95


@dataclass(frozen=True)
class RatioPlan:
    isl: int
    osl: int
    prefill_tps: float  # prompt tokens/s one prefill instance sustains
    decode_tps: float  # output tokens/s one decode instance sustains
    num_prefill: int
    num_decode: int

    @property
    def prefill_s(self) -> float:
        """Prefill-instance seconds per request."""
        return self.isl / self.prefill_tps

    @property
    def decode_s(self) -> float:
        """Decode-instance seconds per request."""
        return self.osl / self.decode_tps

    @property
    def balanced_ratio(self) -> float:
        """P per D at which both pools are equally busy."""
        return self.prefill_s / self.decode_s

    @property
    def max_rate(self) -> float:
        """Requests/s the split sustains (the slower pool's)."""
        return min(self.num_prefill / self.prefill_s, self.num_decode / self.decode_s)

    @property
    def bottleneck(self) -> str:
        p, d = self.num_prefill / self.prefill_s, self.num_decode / self.decode_s
        return "balanced" if math.isclose(p, d, rel_tol=1e-9) else ("prefill" if p < d else "decode")

    @property
    def efficiency(self) -> float:
        """Rate per instance relative to a perfectly balanced split (1.0 = no instance waits on the other pool)."""
        ideal = 1.0 / (self.prefill_s + self.decode_s)
        return self.max_rate / (self.num_prefill + self.num_decode) / ideal

    @property
    def topology(self) -> str:
        return f"{self.num_prefill}p{self.num_decode}d"

    def to_json(self) -> dict[str, Any]:
        return {
            "isl": self.isl, "osl": self.osl, "prefill_tokens_per_s": self.prefill_tps,
            "decode_tokens_per_s": self.decode_tps, "prefill_s_per_request": self.prefill_s,
            "decode_s_per_request": self.decode_s, "balanced_ratio_p_per_d": self.balanced_ratio,
            "num_prefill": self.num_prefill, "num_decode": self.num_decode, "topology": self.topology,
            "max_rate_rps": self.max_rate, "bottleneck": self.bottleneck, "efficiency": self.efficiency,
        }


def _check(isl: int, osl: int, prefill_tps: float, decode_tps: float) -> None:
    if isl < 1 or osl < 1:
        raise ValueError(f"--isl and --osl must be >= 1 (got {isl}, {osl})")
    for name, v in (("--prefill-tps", prefill_tps), ("--decode-tps", decode_tps)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a positive number of tokens/s, got {v}")


def best_split(isl: int, osl: int, prefill_tps: float, decode_tps: float, instances: int) -> RatioPlan:
    """The split of `instances` (>= 2) sustaining the highest request rate (fewer prefill on ties)."""
    _check(isl, osl, prefill_tps, decode_tps)
    if instances < 2:
        raise ValueError(f"--instances must be >= 2 (one prefill and one decode), got {instances}")
    plans = [RatioPlan(isl, osl, prefill_tps, decode_tps, p, instances - p) for p in range(1, instances)]
    return max(plans, key=lambda pl: (round(pl.max_rate, 12), -pl.num_prefill))


def recommend(isl: int, osl: int, prefill_tps: float, decode_tps: float, instances: int | None = None) -> RatioPlan:
    """`best_split` for a given count, else the smallest count whose best split is within 5 % of balanced."""
    if instances is not None:
        return best_split(isl, osl, prefill_tps, decode_tps, instances)
    best: RatioPlan | None = None
    for n in range(2, MAX_AUTO_INSTANCES + 1):
        plan = best_split(isl, osl, prefill_tps, decode_tps, n)
        if plan.efficiency >= EFFICIENCY_GOAL:
            return plan
        if best is None or plan.efficiency > best.efficiency + 1e-12:
            best = plan
    assert best is not None
    return best


def format_ratio(plan: RatioPlan) -> str:
    per_d = plan.balanced_ratio
    return "\n".join([
        f"workload:         ISL {plan.isl:,} tokens in, OSL {plan.osl:,} tokens out",
        f"measured:         prefill {plan.prefill_tps:,.0f} prompt tokens/s per instance, "
        f"decode {plan.decode_tps:,.0f} output tokens/s per instance",
        f"per request:      {plan.prefill_s * 1e3:,.1f} ms of a prefill instance, "
        f"{plan.decode_s * 1e3:,.1f} ms of a decode instance",
        f"balanced ratio:   P:D = {per_d:.3g} : 1" + (f" (1 : {1 / per_d:.3g})" if per_d < 1 else ""),
        f"recommended:      {plan.topology} ({plan.num_prefill} prefill : {plan.num_decode} decode), "
        f"sustains {plan.max_rate:.3g} req/s, {plan.efficiency:.0%} of a balanced split "
        f"(bottleneck: {plan.bottleneck})",
        f"start it:         pdserve up MODEL --topology {plan.topology}   (or pdserve up --ray --from-plan FILE "
        "with this plan's --json; --autoscale then follows the load)",
    ])
