"""One coroutine the proxy runs beside its request handlers (the health checker's rounds, discovery's polls, the
KV fleet's sync, one KV event subscriber each): started once, cancelled and awaited when stopped."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    def __init__(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._run = run
        self._name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts `run()` on the running loop; a second start while it runs changes nothing."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        """Cancels it and waits until it has ended; stopping what is not running changes nothing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
