"""Request arrival times, as `vllm bench serve` draws them (reference section 11.2).

Inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): burstiness 1 is a Poisson
process, < 1 burstier, > 1 more uniform, `inf` a constant 1/rate. The gaps are cumulated, then rescaled
so that the last send time is exactly N/rate. An infinite rate sends everything at t=0.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.RandomState) -> list[float]:
    """Send time of each of `n` requests, in seconds after the first dispatch."""
    if n <= 0:
        return []
    if not burstiness > 0:
        raise ValueError(f"A positive burstiness factor is expected, but given {burstiness}.")
    if not rate > 0:
        raise ValueError(f"Obtained non-positive request rate {rate}.")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if offsets[-1] != 0:
        offsets = offsets * ((n / rate) / offsets[-1])
    return [float(x) for x in offsets]


async def paced(items: Sequence[T], offsets: Sequence[float]) -> AsyncIterator[T]:
    """Yield each item at its offset (seconds) after the first call, never earlier."""
    start = time.perf_counter()
    for item, offset in zip(items, offsets, strict=True):
        if offset > 0:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        yield item
