"""Supervision of a running `pdserve up` deployment: a dead process is restarted with backoff while the
others keep serving; only a crash loop ends the deployment.

Policy (per process name): the k-th restart within `window_s` waits `backoff_s * 2**(k-1)` seconds (capped
at `max_backoff_s`); a death beyond `max_restarts` restarts within the window is a crash loop. The proxy
routes around a dead instance meanwhile (its probes eject it and admit the restarted one).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # 0: no restarts, the first death ends the deployment (the old behaviour)
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def validate(self) -> RestartPolicy:
        if self.max_restarts < 0:
            raise ValueError("--max-restarts must be >= 0")
        if self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("restart window must be > 0 and 0 <= backoff <= max backoff")
        return self


@dataclass
class RestartTracker:
    """When to restart each process, from the times of its recent restarts."""

    policy: RestartPolicy
    clock: Callable[[], float] = time.monotonic
    _restarts: dict[str, deque[float]] = field(default_factory=dict)

    def on_death(self, name: str) -> float | None:
        """Seconds to wait before restarting `name`, or None when this death makes a crash loop."""
        now = self.clock()
        recent = self._restarts.setdefault(name, deque())
        while recent and now - recent[0] > self.policy.window_s:
            recent.popleft()
        if len(recent) >= self.policy.max_restarts:
            return None
        recent.append(now)
        return min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (len(recent) - 1))

    def count(self, name: str) -> int:
        """Restarts of `name` within the current window."""
        return len(self._restarts.get(name, ()))
