"""Periodic `/health` probes: eject an instance after K consecutive failures (requests count too),
keep probing it, re-admit it on the first successful probe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from pdserve.proxy.pool import Instance, Pool

logger = logging.getLogger("pdserve.proxy")


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
    ) -> None:
        self._session = session
        self._pools = pools
        self._interval = interval
        self._timeout = timeout
        self._eject_after = eject_after
        self._task: asyncio.Task[None] | None = None

    async def check(self, inst: Instance) -> bool:
        reason = await probe(self._session, inst, self._timeout)
        if reason is None:
            inst.record_success()
            return True
        logger.debug("%s instance %s: %s", inst.role, inst.url, reason)
        inst.record_failure(reason, self._eject_after)
        return False

    async def check_all(self) -> None:
        instances = [inst for pool in self._pools() for inst in pool.instances]
        if instances:
            await asyncio.gather(*(self.check(inst) for inst in instances))

    async def _run(self) -> None:
        while True:  # a first round at once, so that a dead instance is known early
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking for good
                logger.exception("health check round failed")
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pdserve-proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
