"""What a prefill step costs an instance, as it measured it, and what recomputing history tokens therefore costs at
the margin: the `prefill_cost` a prefill instance advertises in its /pdserve/info and the proxy's multi-turn choice
prices recompute with (issue 42 part 4).

A prefill step of n tokens takes

    step(n) = max(floor_s, fixed_s + n * per_token_s)

`floor_s` is what the shortest step costs. On a GPU it is not reading the weights (5.3 ms for the 8B shape on an
H100) but the host launching an eager forward, kernel by kernel: 14.8-21 ms for the 8B shape's eager step on an
H100 and 19-29 ms on an H200 (BENCHMARKS.md, "The verify step in CUDA graphs" and the H200 table before it), so
the GPU finishes a step of a few hundred tokens before the host has launched it. Past the floor each token costs
`per_token_s` (the GPU's compute, plus the host's per-token work: hashing and registering blocks). Recomputing h
history tokens in the same step as a turn's `new` tokens costs step(new + h) - step(new): nothing while new + h
stays under the ridge (`ridge_tokens`; ~600-900 tokens for the 8B shape on an H100, estimated from its eager step
time), h * per_token_s at most.

The instance measures it (pdserve/engine/prefill_calibration.py: steps of a few prompt lengths at startup, after
the warm-up), because the floor is the host's: a datasheet and the model's shape give the weight-reading floor
and the FLOP rate but not the launch time, and the first version of this model, which priced from them (a
roofline), chose to read 640 held tokens back on an H100 for a predicted 10 ms that cost 0.7-5 ms to recompute
(BENCHMARKS.md, "The multi-turn choice on the GPU").

Not counted: other requests in the same step. A turn alone in its step is priced; turns batched together (several
conversations at once) fill the floor with each other's tokens, and then each recomputed token costs per_token_s.
Standard library only (the proxy and the server both import it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrefillCost:
    device: str  # what measured it (torch's device name)
    floor_s: float  # the shortest prefill step
    fixed_s: float  # the intercept of the per-token line past the floor (may be negative: attention grows)
    per_token_s: float  # each prompt token past the floor
    points: tuple[tuple[int, float], ...] = ()  # the measured (tokens, seconds) it was fitted to, for the record

    def step_s(self, tokens: int) -> float:
        """One prefill step of `tokens` tokens (0: no step)."""
        if tokens <= 0:
            return 0.0
        return max(self.floor_s, self.fixed_s + tokens * self.per_token_s)

    def marginal_s(self, history: int, new: int) -> float:
        """Recomputing `history` tokens in the same step as the turn's `new` tokens (new >= 1: the last prompt
        token is always computed)."""
        if history <= 0:
            return 0.0
        new = max(new, 1)
        return self.step_s(new + history) - self.step_s(new)

    def ridge_tokens(self) -> float:
        """The step size from which each more token costs `per_token_s`."""
        return (self.floor_s - self.fixed_s) / self.per_token_s

    def as_info(self) -> dict[str, Any]:
        return {"device": self.device, "floor_s": self.floor_s, "fixed_s": self.fixed_s,
                "per_token_s": self.per_token_s, "points": [[n, s] for n, s in self.points]}

    @classmethod
    def from_info(cls, info: Any) -> PrefillCost | None:
        """An instance's /pdserve/info `prefill_cost` (None: absent or malformed: a positive floor and per-token
        cost, a finite intercept)."""
        if not isinstance(info, Mapping):
            return None
        nums = {}
        for name in ("floor_s", "fixed_s", "per_token_s"):
            v = info.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                return None
            nums[name] = float(v)
        if nums["floor_s"] <= 0 or nums["per_token_s"] <= 0:
            return None
        device = info.get("device")
        return cls(device if isinstance(device, str) else "unknown", **nums, points=_points(info.get("points")))

    @classmethod
    def fit(cls, device: str, points: Iterable[tuple[int, float]]) -> PrefillCost | None:
        """The model through measured (tokens, seconds) steps: the floor is the shortest step's time, the line
        runs through the two longest steps. When the longest steps are no slower than the shortest (a small model
        whose every measured step sat on the floor), the line is put through the origin and the longest step, i.e.
        the ridge at the longest length measured: recompute is free within what was measured and not beyond.
        None for fewer than three lengths or a non-positive time."""
        pts = sorted((int(n), float(s)) for n, s in points)
        if len({n for n, _ in pts}) != len(pts) or len(pts) < 3 or any(n <= 0 or s <= 0 for n, s in pts):
            return None
        floor = pts[0][1]
        (n1, s1), (n2, s2) = pts[-2], pts[-1]
        slope = (s2 - s1) / (n2 - n1)
        if slope <= 0 or s2 <= floor:
            slope, fixed = max(s2, floor) / n2, 0.0
        else:
            fixed = s2 - n2 * slope
        return cls(device, floor, fixed, slope, tuple(pts))


def _points(value: Any) -> tuple[tuple[int, float], ...]:
    """The advertised measurements, for the record only (a malformed list reads as none)."""
    if not isinstance(value, list):
        return ()
    out = []
    for p in value:
        if not (isinstance(p, list) and len(p) == 2 and type(p[0]) is int
                and isinstance(p[1], (int, float)) and not isinstance(p[1], bool)):
            return ()
        out.append((p[0], float(p[1])))
    return tuple(out)


def dearest_marginal_s(costs: Iterable[PrefillCost], history: int, new: int) -> float:
    """The prefill fleet's price of recomputing: the dearest instance's margin (the one that will serve the turn is
    not chosen yet; the choice errs towards reading)."""
    return max((c.marginal_s(history, new) for c in costs), default=0.0)
