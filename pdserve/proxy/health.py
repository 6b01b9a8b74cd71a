"""Periodic `/health` probes: admit an instance on its first successful probe, eject it after K
consecutive failures (requests count too), keep probing it, re-admit it on the next successful probe.

While some instance is not admitted (starting, ejected) or has failed recently, rounds run at least every
`FAST_INTERVAL_S`, so a (re)started instance is admitted within about a second; a request that finds no
instance available can also ask for a round at once (`nudge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from pdserve.proxy.background import BackgroundTask
from pdserve.proxy.instance_info import read_instance_info
from pdserve.proxy.pool import Instance, Pool

logger = logging.getLogger("pdserve.proxy")

FAST_INTERVAL_S = 1.0
MIN_ROUND_GAP_S = 0.2  # nudges never probe more often than this


async def probe(session: aiohttp.ClientSession, inst: Instance, timeout: float) -> str | None:
    """GET <url>/health; None when healthy, else the reason."""
    try:
        async with session.get(
            inst.endpoint("/health"), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            await resp.read()
            if resp.status == 200:
                return None
            return f"health status {resp.status}"
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return f"health probe: {type(exc).__name__}: {exc}"


class HealthChecker:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        pools: Callable[[], list[Pool]],
        *,
        interval: float,
        timeout: float,
        eject_after: int,
        on_admit: Callable[[], None] = lambda: None,
    ) -> None:
        self._session = session
        self._pools = pools
        self._interval = interval
        self._timeout = timeout
        self._eject_after = eject_after
        self._on_admit = on_admit
        self._background = BackgroundTask(self._run, "pdserve-proxy-health")
        self._wake = asyncio.Event()
        self._last_round = 0.0

    def nudge(self) -> None:
        """Ask for a probe round now (a request is waiting for an instance)."""
        self._wake.set()

    async def check(self, inst: Instance) -> bool:
        reason = await probe(self._session, inst, self._timeout)
        if reason is None:
            if not inst.healthy or inst.pdserve is None:
                # what the instance is (pdserve or not, push or pull) may have changed across a restart: read
                # it again on each admission, before the instance can be chosen
                await read_instance_info(self._session, inst, self._timeout)
            admitted = inst.record_success()
            if admitted:
                self._on_admit()
            return True
        logger.debug("%s instance %s: %s", inst.role, inst.url, reason)
        inst.record_failure(reason, self._eject_after)
        return False

    async def check_all(self) -> None:
        instances = [inst for pool in self._pools() for inst in pool.instances]
        if instances:
            await asyncio.gather(*(self.check(inst) for inst in instances))

    def _next_interval(self) -> float:
        settled = all(
            inst.healthy and inst.consecutive_failures == 0 for pool in self._pools() for inst in pool.instances
        )
        return self._interval if settled else min(self._interval, FAST_INTERVAL_S)

    async def _run(self) -> None:
        while True:  # a first round at once, so that instances are admitted (or known dead) early
            self._wake.clear()
            self._last_round = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking for good
                logger.exception("health check round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._next_interval())
            gap = self._last_round + MIN_ROUND_GAP_S - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)

    def start(self) -> None:
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()
