"""Instance discovery: the proxy's pools follow a registry instead of fixed --prefill/--decode lists.

A *source* (a blocking callable, run in a worker thread) returns the current members: a stable name, a
role, the URL the instance serves at now, and its state. `Reconciler.apply` turns each list into pool
changes; `Discovery` polls the source every `interval` seconds inside the proxy's event loop. Under Ray the
source lists the app's named instance actors (pdserve/launch/ray_registry.py), so the proxy follows
instances that join (scale-up), leave (scale-down, drain) and come back at a new address (a restart by
Ray) without a restart of its own.

What counts as a member:
- `starting` and `serving` members are in their pool (added unadmitted: the health checker admits them on
  their first successful /health probe, as for any instance);
- `draining`, `stopping`, `stopped` and `failed` members are taken out at once: legs in flight finish,
  no new leg is sent (this is how a scale-down or a role switch drains an instance);
- a member that did not answer (`url` None: Ray is restarting it, or it is busy) keeps its last URL for
  `unresponsive_after` rounds, then leaves its pool; health probes and failed legs eject a dead URL
  sooner. When it answers again at a new URL, the old one is replaced at once.
A failing source (registry unreachable) changes nothing: the pools stay as they are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from pdserve.proxy.background import BackgroundTask
from pdserve.proxy.pool import normalize_url
from pdserve.proxy.state import ProxyState

logger = logging.getLogger("pdserve.proxy")

ROUTED_STATES = ("starting", "serving")


@dataclass(frozen=True)
class Member:
    name: str  # stable across restarts (a Ray actor name)
    role: str  # prefill | decode | collocated (collocated replicas form the decode pool)
    url: str | None  # None: did not answer this round
    state: str = "serving"  # starting | serving | draining | stopping | stopped | failed


def pool_role(role: str) -> str:
    return "prefill" if role == "prefill" else "decode"


class Reconciler:
    """Applies successive member lists to a proxy's pools (see the module docstring for the rules)."""

    def __init__(self, state: ProxyState, *, unresponsive_after: int = 2) -> None:
        self._state = state
        self._unresponsive_after = max(1, unresponsive_after)
        self._last: dict[str, tuple[str, str]] = {}  # name -> (pool role, url) last routed
        self._missed: dict[str, int] = {}

    def apply(self, members: Sequence[Member]) -> list[str]:
        """Adds and removes pool instances so that the pools hold exactly the routed members' URLs.
        Returns one line per change (empty when nothing changed)."""
        wanted: dict[tuple[str, str], str] = {}  # (pool role, url) -> member name
        seen: set[str] = set()
        for m in members:
            seen.add(m.name)
            if m.url is None:
                missed = self._missed.get(m.name, 0) + 1
                self._missed[m.name] = missed
                last = self._last.get(m.name)
                if last is not None and missed < self._unresponsive_after:
                    wanted[last] = m.name
                elif last is not None:
                    del self._last[m.name]
                continue
            self._missed.pop(m.name, None)
            if m.state not in ROUTED_STATES:
                self._last.pop(m.name, None)
                continue
            key = (pool_role(m.role), normalize_url(m.url))
            self._last[m.name] = key
            wanted[key] = m.name
        for name in list(self._last):
            if name not in seen:  # the member is gone for good (killed, scaled down)
                del self._last[name]
                self._missed.pop(name, None)
        changes: list[str] = []
        for pool in self._state.pools():
            for inst in pool.instances:
                if (pool.role, inst.url) not in wanted:
                    pool.remove(inst.url)
                    changes.append(f"removed {pool.role} {inst.url} ({inst.in_flight} legs in flight finish)")
        for (role, url), name in wanted.items():
            pool = self._state.pool(role)
            if pool.get(url) is None:
                pool.add(url)  # unadmitted until its first successful /health probe
                changes.append(f"added {role} {url} ({name})")
        return changes


class Discovery:
    """Polls `source` every `interval` seconds and reconciles the proxy's pools with its answer."""

    def __init__(self, state: ProxyState, source: Callable[[], Sequence[Member]], *, interval: float,
                 unresponsive_after: int = 2) -> None:
        self._state = state
        self._source = source
        self._interval = interval
        self.reconciler = Reconciler(state, unresponsive_after=unresponsive_after)
        self.rounds = 0
        self._background = BackgroundTask(self._run, "pdserve-proxy-discovery")

    async def sync_once(self) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            members = await loop.run_in_executor(None, self._source)
        except Exception as exc:  # the registry may be briefly unreachable: keep the pools as they are
            logger.warning("instance discovery failed (pools unchanged): %s: %s", type(exc).__name__, exc)
            return []
        changes = self.reconciler.apply(members)
        self.rounds += 1
        for line in changes:
            logger.warning("discovery: %s", line)
        if changes:
            self._state.nudge_health()  # probe new instances now rather than at the next interval
        return changes

    async def _run(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()

    def cleanup_ctx(self) -> Callable[[object], AsyncIterator[None]]:
        """For `app.cleanup_ctx.append(...)` after create_app's own entry (which opens the HTTP session)."""

        async def ctx(app: object) -> AsyncIterator[None]:
            await self.sync_once()  # the first round before serving: pools match the registry from the start
            self.start()
            yield
            await self.stop()

        return ctx
