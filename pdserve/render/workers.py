"""Where the CPU work of the render tier runs (`--renderer-num-workers`).

Templating, tokenisation and detokenisation are CPU-bound and partly hold the GIL (Jinja), so they never
run on the event loop. One worker (the default) is one dedicated thread in the server process; N > 1 are
N spawned processes, each with its own tokenizer, fed through a `ProcessPoolExecutor`. Every job is a
plain function of JSON-able arguments, and errors come back as data (status, message, param) so they
cross the process boundary intact.

No worker outlives the server: `shutdown` joins them (bounded) and terminates what remains, and each
worker also exits by itself once its parent is gone (a SIGKILLed server, a signal during startup), since
a pool worker holds its own task queue's write end and so never sees the pipe close. The multiprocessing
resource tracker then exits too (it lives until the last holder of its pipe is gone).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from pdserve.api.openai.errors import APIError
from pdserve.render.context import RenderConfig, RenderContext
from pdserve.render.derender import derender_chat, derender_completion
from pdserve.render.render import render_chat, render_completion
from pdserve.render.utility import detokenize, tokenize

log = logging.getLogger("pdserve.render")

JOBS: dict[str, Callable[..., Any]] = {
    "render_chat": render_chat,
    "render_completion": render_completion,
    "derender_chat": derender_chat,
    "derender_completion": derender_completion,
    "tokenize": tokenize,
    "detokenize": detokenize,
    "ping": lambda ctx: True,
    "torch_loaded": lambda ctx: "torch" in sys.modules,
}

_worker_ctx: RenderContext | None = None  # per worker process
_worker_thread: ThreadPoolExecutor | None = None
PARENT_POLL_S = 1.0
SHUTDOWN_JOIN_S = 5.0


def run_job(ctx: RenderContext, name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        return ("ok", JOBS[name](ctx, *args))
    except APIError as e:
        return ("err", e.status, e.message, e.param, e.err_type)
    except (RecursionError, OverflowError) as e:
        return ("err", 400, f"Invalid request: {e}", None, None)


def _exit_with_parent(parent: int) -> None:
    """In a worker: leave as soon as the server process that started it is gone (reparented)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="pdserve-render-parent-watch", daemon=True).start()


def _init_worker(config: RenderConfig, parent: int) -> None:
    global _worker_ctx, _worker_thread
    _exit_with_parent(parent)
    _worker_ctx = RenderContext(config)
    # Jobs run on a secondary thread: measured on glibc, tokenising a long prompt there is ~1.5x faster than
    # on a process's main thread (whose malloc arena Python's own allocations share).
    _worker_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-render")


def _run_in_worker(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    assert _worker_ctx is not None and _worker_thread is not None, "render worker used before its initializer"
    return _worker_thread.submit(run_job, _worker_ctx, name, args).result()


class RenderWorkers:
    def __init__(self, config: RenderConfig, num_workers: int = 1, ctx: RenderContext | None = None):
        if num_workers < 1:
            raise ValueError("--renderer-num-workers must be at least 1")
        self.config = config
        self.num_workers = num_workers
        self.ctx = ctx or RenderContext(config)  # also answers the cheap in-process questions
        self._executor: Executor
        if num_workers == 1:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pdserve-render")
        else:
            self._executor = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_init_worker, initargs=(config, os.getpid()))

    async def start(self) -> None:
        """Starts every worker (each loads its tokenizer) before the server reports healthy."""
        await asyncio.gather(*(self.call("ping") for _ in range(self.num_workers)))

    async def call(self, name: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if isinstance(self._executor, ThreadPoolExecutor):
            result = await loop.run_in_executor(self._executor, run_job, self.ctx, name, args)
        else:
            result = await loop.run_in_executor(self._executor, _run_in_worker, name, args)
        if result[0] == "ok":
            return result[1]
        _, status, message, param, err_type = result
        raise APIError(message, status, param, err_type)

    def shutdown(self, timeout: float = SHUTDOWN_JOIN_S) -> None:
        """Stop the workers: queued jobs are cancelled, worker processes joined up to `timeout` seconds,
        then terminated (killed if need be). Idempotent."""
        executor = self._executor
        # ProcessPoolExecutor keeps its processes in `_processes` (no public accessor); read it before
        # shutdown clears it.
        procs = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                log.warning("render worker %s did not exit in %.0fs: terminating it", proc.pid, timeout)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
