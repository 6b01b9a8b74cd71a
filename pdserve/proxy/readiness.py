"""Choosing an instance when none may be ready yet: a bounded wait instead of an immediate failure.

A request that finds no available instance in a pool (all starting, ejected or backing off) asks the
health checker for a probe round now and waits until an instance is admitted, a back-off ends, or
`--instance-wait-timeout` passes; then the caller answers 503 with `Retry-After`. This is what lets a proxy
started together with its instances (README's three commands, `pdserve up` restarting one) answer its
first request instead of a 502. The waiting chooser is pdserve/proxy/pairing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from aiohttp import web

from pdserve.proxy.errors import error_response
from pdserve.proxy.pool import Pool
from pdserve.proxy.retry import retry_after_header

if TYPE_CHECKING:
    from pdserve.proxy.state import ProxyState


class Readiness:
    """Wakes every waiter when an instance is admitted (one event per generation of waiters)."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


def retry_after_s(pool: Pool, health_interval: float) -> float:
    """How long a client should wait when `pool` has nothing available: the end of the shortest upstream
    back-off, else about one health-probe interval (when a recovering instance can be admitted)."""
    backoff = pool.backoff_left()
    return backoff if backoff is not None else min(health_interval, 5.0)


def no_instance_response(state: ProxyState, role: str, rid: str | None, seconds: float | None = None) -> web.Response:
    """503 with Retry-After: no `role` instance became available within --instance-wait-timeout."""
    state.metrics.error("no_instance")
    if seconds is None:
        seconds = retry_after_s(state.pool(role), state.config.health_interval)
    return error_response(
        503,
        f"no {role} instance available (none became ready within {state.config.instance_wait_timeout:g}s)",
        "ServiceUnavailableError",
        request_id=rid,
        headers={"Retry-After": retry_after_header(seconds)},
    )
