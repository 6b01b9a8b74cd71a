"""The P/D proxy as a Ray actor: `pdserve proxy`'s aiohttp app plus discovery of the app's instances.

The app runs on its own thread and event loop (uvloop when available, as `pdserve proxy`), started in the
actor's constructor: when Ray restarts the actor after a crash, the constructor runs again and the proxy
is back on the same address (the controller pins the actor to the driver's node and passes a concrete
port). Its pools start from the instances known at creation and then follow Ray's named instance actors
(pdserve/proxy/discovery.py with the source of pdserve/launch/ray_registry.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from pdserve.proxy.config import ProxyConfig

logger = logging.getLogger("pdserve.proxy")

START_TIMEOUT_S = 60.0


class ProxyServer:
    """The actor class (wrapped with `ray.remote` by the controller)."""

    def __init__(self, config: dict[str, Any], namespace: str, prefix: str, discovery_interval: float) -> None:
        import ray

        self.config = ProxyConfig(**config).validate()
        self.namespace = namespace
        self.prefix = prefix
        self.discovery_interval = discovery_interval
        self.node_ip = ray.util.get_node_ip_address()
        self.url: str | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: Any = None
        self._discovery: Any = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the proxy did not start within {START_TIMEOUT_S:g}s")
        if self.error is not None:
            raise RuntimeError(f"the proxy could not start on {self.config.host}:{self.config.port}: "
                               f"{type(self.error).__name__}: {self.error}")

    def _run(self) -> None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by the constructor (or logged by Ray if later)
            self.error = exc
            self._started.set()
            raise
        finally:
            loop.close()

    async def _serve(self) -> None:
        from aiohttp import web

        from pdserve.bindcheck import exposure_warning
        from pdserve.launch.ray_registry import list_members
        from pdserve.proxy.app import STATE_KEY, create_app
        from pdserve.proxy.discovery import Discovery

        warning = exposure_warning("pdserve proxy", self.config.host, self.config.api_key)
        if warning:
            logger.warning("%s", warning)
        app = create_app(self.config)
        state = app[STATE_KEY]
        timeout = max(0.5, min(2.0, self.discovery_interval))
        discovery = Discovery(state, lambda: list_members(self.namespace, self.prefix, timeout),
                              interval=self.discovery_interval)
        app.cleanup_ctx.append(discovery.cleanup_ctx())  # after create_app's: the HTTP session is open
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=10.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port, backlog=4096)
            await site.start()
            self._state, self._discovery = state, discovery
            self._stop = asyncio.Event()
            self.url = f"http://{self.config.host}:{self.config.port}"
            self._started.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- actor methods ---------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        import ray

        return {"url": self.url, "pid": os.getpid(), "node_ip": self.node_ip,
                "node_id": ray.get_runtime_context().get_node_id(),
                "discovery_rounds": self._discovery.rounds if self._discovery is not None else 0}

    def listing(self) -> dict[str, list[dict[str, Any]]]:
        """What GET /pdserve/instances answers: the pools as the proxy routes now."""

        async def snapshot() -> dict[str, list[dict[str, Any]]]:
            return {pool.role: [inst.to_json() for inst in pool.instances] for pool in self._state.pools()}

        return self._call(snapshot())

    def sync(self) -> list[str]:
        """One discovery round now (the controller calls it right after draining an instance)."""
        return self._call(self._discovery.sync_once())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=15)
