"""When to add, remove or switch a prefill or decode replica: a pure function of the window's signals.

Per role, a desired replica count:
- by load (target tracking, Ray Serve's `target_ongoing_requests`): ceil(ongoing / target); without a
  target, the current count while anything is in flight and the minimum when the pool is idle;
- under pressure, at least one more than now: the latency quantile over its SLO (TTFT for prefill, ITL
  for decode), KV-cache usage over `kv_usage_high` (decode), or a queue of `waiting_high` requests or
  more per replica;
- never fewer than now while there is no headroom: latency above `down_margin` x SLO, KV usage above
  `down_margin` x high, or more than `down_margin` x `waiting_high` requests waiting per replica;
- within [min, max].
A role whose desired count stays above its count for `upscale_delay_s` is due to grow; below for
`downscale_delay_s`, due to shrink (hysteresis: a short burst or lull changes nothing). One action at a
time: a role due to grow takes a replica from the other role by a *switch* when that role has one to
spare (its desired count is below its count and above its minimum), else gets a new one (*scale_up*);
otherwise a role due to shrink loses one (*scale_down*). After an action the timers restart, so the next
decision is made on numbers measured with the new replica counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.autoscale.signals import RoleSignals

ROLES = ("prefill", "decode")
LATENCY_NAME = {"prefill": "TTFT", "decode": "ITL"}


@dataclass
class RoleLimits:
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing: float | None = None  # legs in flight per replica; None: no load target
    latency_slo_s: float | None = None  # TTFT (prefill) or ITL (decode) at the quantile; None: none

    def validate(self, role: str) -> None:
        if self.min_replicas < 1 or self.max_replicas < self.min_replicas:
            raise ValueError(f"{role}: need 1 <= min ({self.min_replicas}) <= max ({self.max_replicas})")
        if self.target_ongoing is not None and self.target_ongoing <= 0:
            raise ValueError(f"{role}: the ongoing-requests target must be > 0")
        if self.latency_slo_s is not None and self.latency_slo_s <= 0:
            raise ValueError(f"{role}: the latency SLO must be > 0")


@dataclass
class AutoscaleConfig:
    prefill: RoleLimits = field(default_factory=RoleLimits)
    decode: RoleLimits = field(default_factory=RoleLimits)
    quantile: float = 0.9  # of TTFT and ITL over the window, compared with the SLOs
    kv_usage_high: float = 0.9
    waiting_high: float = 1.0  # requests waiting per replica, averaged over the window
    down_margin: float = 0.7
    interval_s: float = 2.0
    window_s: float = 20.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    allow_role_switch: bool = True
    drain_timeout_s: float = 120.0

    def limits(self, role: str) -> RoleLimits:
        return self.prefill if role == "prefill" else self.decode

    def validate(self) -> AutoscaleConfig:
        for role in ROLES:
            self.limits(role).validate(role)
        if not 0 < self.quantile < 1:
            raise ValueError("the latency quantile must be in (0, 1)")
        if not 0 < self.down_margin <= 1:
            raise ValueError("down_margin must be in (0, 1]")
        for name in ("interval_s", "window_s", "drain_timeout_s", "kv_usage_high", "waiting_high"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        return self

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AutoscaleConfig:
        d = dict(data)
        for role in ROLES:
            if isinstance(d.get(role), dict):
                d[role] = RoleLimits(**d[role])
        return cls(**d)


@dataclass(frozen=True)
class RoleView:
    """A role's signals, its desired count and why."""

    signals: RoleSignals
    desired: int
    pressure: tuple[str, ...]  # reasons for at least one more replica
    holds: tuple[str, ...]  # reasons not to go below the current count

    def to_json(self) -> dict[str, Any]:
        return {**self.signals.to_json(), "desired": self.desired, "pressure": list(self.pressure),
                "holds": list(self.holds)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def view(role: str, sig: RoleSignals, cfg: AutoscaleConfig) -> RoleView:
    lim = cfg.limits(role)
    n = sig.replicas
    if lim.target_ongoing:
        by_load = math.ceil(sig.ongoing / lim.target_ongoing - 1e-9)
    else:  # without a load target only an idle pool shrinks (to its minimum)
        by_load = n if sig.ongoing > 0 or sig.waiting > 0 else 0
    pressure: list[str] = []
    holds: list[str] = []
    q = f"p{cfg.quantile * 100:g}"
    name = LATENCY_NAME[role]
    if lim.latency_slo_s is not None and sig.latency_q is not None:
        if sig.latency_q > lim.latency_slo_s:
            pressure.append(f"{name} {q} {_ms(sig.latency_q)} > SLO {_ms(lim.latency_slo_s)}")
        elif sig.latency_q > cfg.down_margin * lim.latency_slo_s:
            holds.append(f"{name} {q} {_ms(sig.latency_q)} > {cfg.down_margin:g} x SLO")
    if role == "decode" and sig.kv_usage is not None:
        if sig.kv_usage > cfg.kv_usage_high:
            pressure.append(f"KV usage {sig.kv_usage:.0%} > {cfg.kv_usage_high:.0%}")
        elif sig.kv_usage > cfg.down_margin * cfg.kv_usage_high:
            holds.append(f"KV usage {sig.kv_usage:.0%} > {cfg.down_margin:g} x {cfg.kv_usage_high:.0%}")
    waiting_each = sig.waiting / n if n else 0.0
    if n and waiting_each >= cfg.waiting_high:
        pressure.append(f"{waiting_each:.2f} waiting per replica >= {cfg.waiting_high:g}")
    elif waiting_each > cfg.down_margin * cfg.waiting_high:
        # (not "anything waiting": the gauge is sampled, and a request caught between its arrival and the
        # next engine step in one tick of the window is not a queue)
        holds.append(f"{waiting_each:.2f} waiting per replica > {cfg.down_margin:g} x {cfg.waiting_high:g}")
    if lim.target_ongoing:
        if by_load > n:
            pressure.append(f"{sig.ongoing:.2f} ongoing / target {lim.target_ongoing:g} per replica "
                            f"-> {by_load} replicas")
        elif by_load == n and n:
            holds.append(f"{sig.ongoing:.2f} ongoing needs {n} at target {lim.target_ongoing:g}")
    desired = by_load
    if pressure:
        desired = max(desired, n + 1)
    elif holds:
        desired = max(desired, n)
    clamped = max(lim.min_replicas, min(lim.max_replicas, desired))
    if clamped < desired:
        holds.append(f"at most {lim.max_replicas} (--max-{role})")
    return RoleView(sig, clamped, tuple(pressure), tuple(holds))


@dataclass(frozen=True)
class Decision:
    action: str  # scale_up | scale_down | switch
    role: str  # the role that gains (scale_up, switch) or loses (scale_down) a replica
    from_role: str | None  # switch: the role that gives one up
    reason: str
    numbers: dict[str, Any]  # role -> RoleView.to_json()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.action == "switch":
            return f"switch one {self.from_role} replica to {self.role}: {self.reason}"
        verb = "add" if self.action == "scale_up" else "remove"
        return f"{verb} one {self.role} replica: {self.reason}"


def _held_for(since: dict[str, float | None], opposite: dict[str, float | None], role: str, now: float,
              delay_s: float) -> bool:
    """Whether `role`'s wish (`since`: when it began) has held `delay_s` by `now`; the opposite wish's timer
    stops, this one starts if it has not."""
    opposite[role] = None
    start = since[role]
    if start is None:  # (0.0 is a time: no `or`)
        start = since[role] = now
    return now - start >= delay_s


class Autoscaler:
    """The hysteresis state (since when each role wants more or fewer) and the choice of one action."""

    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg.validate()
        self._above_since: dict[str, float | None] = dict.fromkeys(ROLES)
        self._below_since: dict[str, float | None] = dict.fromkeys(ROLES)
        self.last_views: dict[str, RoleView] = {}

    def reset(self) -> None:
        """Forget the timers (after an action, or while one runs)."""
        self._above_since = dict.fromkeys(ROLES)
        self._below_since = dict.fromkeys(ROLES)

    def step(self, now: float, signals: dict[str, RoleSignals]) -> Decision | None:
        views = {role: view(role, signals[role], self.cfg) for role in ROLES}
        self.last_views = views
        due_up, due_down = [], []
        for role, v in views.items():
            n = v.signals.replicas
            if v.desired > n:
                if _held_for(self._above_since, self._below_since, role, now, self.cfg.upscale_delay_s):
                    due_up.append(role)
            elif v.desired < n:
                if _held_for(self._below_since, self._above_since, role, now, self.cfg.downscale_delay_s):
                    due_down.append(role)
            else:
                self._above_since[role] = self._below_since[role] = None
        numbers = {role: v.to_json() for role, v in views.items()}
        decision: Decision | None = None
        if due_up:
            # the role furthest above its count first (relative to it)
            role = max(due_up, key=lambda r: (views[r].desired - views[r].signals.replicas)
                       / max(1, views[r].signals.replicas))
            other = "decode" if role == "prefill" else "prefill"
            ov = views[other]
            reason = "; ".join(views[role].pressure) or f"desired {views[role].desired}"
            spare = ov.desired < ov.signals.replicas and ov.signals.replicas > self.cfg.limits(other).min_replicas
            if self.cfg.allow_role_switch and spare:
                decision = Decision("switch", role, other, f"{reason}; {other} has one to spare "
                                    f"(desired {ov.desired} < {ov.signals.replicas})", numbers)
            else:
                decision = Decision("scale_up", role, None, reason, numbers)
        elif due_down:
            role = due_down[0]
            v = views[role]
            lim = self.cfg.limits(role)
            load = (f"{v.signals.ongoing:.2f} ongoing / target {lim.target_ongoing:g}" if lim.target_ongoing
                    else "no pressure")
            decision = Decision("scale_down", role, None, f"{load} -> desired {v.desired} < "
                                f"{v.signals.replicas} for {self.cfg.downscale_delay_s:g}s", numbers)
        if decision is not None:
            self.reset()
        return decision
