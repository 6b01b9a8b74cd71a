"""Reading what every tier exposes on `GET /metrics` (Prometheus' text format, vLLM's metric names): the
quantile of a histogram, which the autoscaler (its latency signals) and the benchmark (its transfer check)
both compute from scraped bucket counts."""

from __future__ import annotations

import math
from collections.abc import Iterable


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative (upper bound, count of observations <= it) buckets: linear
    interpolation inside the bucket holding rank q x count; the highest finite bound when the rank falls in
    +Inf; None without observations."""
    items = sorted(buckets)
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in items:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound
