"""Retry policy of the proxy: one retry budget for the whole proxy, and upstream `Retry-After`.

Why a budget: every retry or decode-local fallback after a leg that reached an instance may redo a
prefill. Without a bound, an error storm (an overloaded prefill pool answering 5xx, timeouts) multiplies
the very work that is failing. The proxy is the single owner of retries (instances do not retry), and it
caps them like Finagle's and Envoy's retry budgets: each client request deposits `ratio` tokens into a
bucket, each retry takes one, and a floor of `min_per_s` tokens per second keeps retries possible at low
traffic. Over any window, retries <= burst + ratio x requests + min_per_s x seconds, so prefill work stays
within about (1 + ratio)x of the traffic (the seed article's "single-owner retry budgets ... cap overhead
at 1.04x"). A retry after a connect failure is free: that leg never reached an instance, so no work is
repeated.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime

# An upstream asking for a longer pause than this is capped: a misconfigured instance must not park
# itself for hours; the health probes still decide whether it is there at all.
MAX_RETRY_AFTER_S = 300.0


class RetryBudget:
    def __init__(
        self,
        ratio: float,
        min_per_s: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ratio < 0 or min_per_s < 0 or burst < 1:
            raise ValueError("retry budget: ratio and min_per_s must be >= 0, burst >= 1")
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.burst = float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.min_per_s)
        self._last = now

    def deposit(self) -> None:
        """One client request arrived."""
        self._refill()
        self._tokens = min(self.burst, self._tokens + self.ratio)

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and nothing taken) when it is exhausted."""
        self._refill()
        if self._tokens >= 1.0 - 1e-9:  # ten deposits of 0.1 make one retry despite float rounding
            self._tokens = max(0.0, self._tokens - 1.0)
            return True
        return False

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from an HTTP `Retry-After` header (delay-seconds or an HTTP-date); None if absent or bad."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        seconds = float(text)
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        current = datetime.now(UTC).timestamp() if now is None else now
        seconds = when.timestamp() - current
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


def retry_after_header(seconds: float) -> str:
    """A `Retry-After` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
