"""Runs LLMEngine's step loop in its own thread and hands outputs to asyncio callers.

HTTP handling stays on the event loop; the engine thread spends its time in torch ops, which release
the GIL, so neither starves the other. The two sides share no engine state: the asyncio side asks through typed
commands (engine/commands.py) on one queue, and reads the engine only through the stats snapshot the engine
thread publishes once per turn of its loop (`stats`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.api.pd import HeldKVParams, KVTransferParams
from pdserve.engine.commands import Abort, AddRequest, DeliverParams, EngineCommand, PinPrefix
from pdserve.engine.engine import LLMEngine
from pdserve.engine.events import DeliveryRefused
from pdserve.engine.stats import EngineStats
from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import RequestOutput
from pdserve.types.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine")


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured bound (the server answers 503)."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, extension_factory: Any = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config, extension_factory)
        self.config = config
        # the engine's counts as the engine thread last read them (once per turn of its loop, after the step and
        # before its outputs go out): the asyncio side's one view of engine state
        self._stats: EngineStats = self.engine.stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.dead_error: BaseException | None = None
        # called once from the engine thread when the loop dies (the server uses it to exit)
        self.on_dead: Callable[[BaseException], None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # a claimed lease or an ended load wakes the engine thread at once (not at its next 1 ms poll)
        self.engine.on_background_event(self._wake.set)
        self._thread = threading.Thread(target=self._run_loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self.engine.shutdown()

    @property
    def model_config(self):
        return self.engine.model_cfg

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The latest snapshot (metrics scrapes, the queue bound): never read across threads while a step runs."""
        return self._stats

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_transfer_params: KVTransferParams | None = None) -> AsyncIterator[RequestOutput]:
        """Yields output deltas; the last has finished=True. Raises ParamError for client mistakes
        before the first yield. Cancelling the iteration (client gone) aborts the request."""
        self._check_alive()
        bound = self.config.max_waiting_requests
        if bound is not None and self._stats.num_queued + self._commands.qsize() >= bound:
            raise QueueFullError(f"the server's waiting queue is full ({bound} requests)")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        done = self._post(AddRequest(request_id, prompt_token_ids, params, kv_transfer_params))
        finished = False
        try:
            await done  # raises the engine's validation error, if any
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(Abort(request_id), answered=False)

    async def deliver_params(self, key: str, kv_transfer_params: KVTransferParams) -> None:
        """The prefill's params for a decode leg sent before them (`EnginePD.deliver_params`); raises
        ParamError when they are refused (the waiting leg then ends with the same 400)."""
        self._check_alive()
        await self._post(DeliverParams(key, kv_transfer_params))

    async def pin_cached_prefix(self, token_ids: list[int], min_tokens: int) -> HeldKVParams | None:
        """`EnginePD.pin_cached_prefix`, run on the engine thread (raises PinRefused)."""
        self._check_alive()
        return await self._post(PinPrefix(token_ids, min_tokens))

    async def abort(self, request_id: str) -> None:
        self._post(Abort(request_id), answered=False)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error}")

    def _post(self, command: EngineCommand, answered: bool = True) -> asyncio.Future | None:
        """Queues a command for the engine thread and wakes it; the future its answer resolves (None when
        `answered` is false: nobody waits for it)."""
        fut = asyncio.get_running_loop().create_future() if answered else None
        self._commands.put((command, fut))
        self._wake.set()
        return fut

    # ---- the engine thread -------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _resolve(self, fut: asyncio.Future, error: BaseException | None, result: object = None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    def _run(self, command: EngineCommand) -> tuple[object, list[RequestOutput]]:
        """One command on the engine: its answer and the outputs it made."""
        engine = self.engine
        match command:
            case AddRequest(request_id, prompt, params, kv):
                engine.add_request(request_id, prompt, params, kv)
                return None, []
            case DeliverParams() | PinPrefix():  # the engine's extension's own (the P/D half's)
                return engine.call_extension(command)
            case Abort(request_id):
                out = engine.abort_request(request_id)
                return None, [out] if out is not None else []

    def _drain_commands(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        ran = False
        while True:
            try:
                command, fut = self._commands.get_nowait()
            except queue.Empty:
                if ran:  # the requests added leave the command queue's count: the snapshot's count has them
                    self._stats = self.engine.stats()
                return outputs
            ran = True
            result, err = None, None
            try:
                result, made = self._run(command)
                outputs.extend(made)
            except DeliveryRefused as e:  # the waiting leg ended: its output goes out, the delivery is refused
                outputs.extend(e.outputs)
                err = e
            except Exception as e:  # noqa: BLE001 - reported to the caller, engine keeps going
                if fut is None:
                    raise  # nobody to report it to (an abort): the loop dies, as before
                err = e
            if fut is not None:
                self._loop.call_soon_threadsafe(self._resolve, fut, err, result)

    def _run_loop(self) -> None:
        assert self._loop is not None
        engine = self.engine
        try:
            while not self._stop.is_set():
                engine.check_health()
                outputs = self._drain_commands()
                state = engine.loop_state()
                if state.unfinished or state.background:
                    outputs.extend(engine.step())
                self._stats = engine.stats()  # before the outputs: who sees them sees at least this snapshot
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
                state = engine.loop_state()
                if not state.unfinished:
                    engine.idle()  # e.g. the disk tier's writes that finished meanwhile
                    # Idle: sleep until a command arrives (bounded, so held leases still get reaped).
                    self._wake.wait(0.01 if state.idle_poll else 0.05)
                    self._wake.clear()
                elif not state.schedulable:
                    # only remote or disk-tier loads in flight (polled; remote claims and outcomes also wake
                    # us), or decode legs waiting for their params (whose delivery is a command, which wakes us)
                    self._wake.wait(0.001 if state.polled else 0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail every waiting request
            log.exception("engine loop died")
            self.dead_error = e
            err = EngineDeadError(f"the engine has stopped: {e}")
            self._loop.call_soon_threadsafe(self._fail_all, err)
            if self.on_dead is not None:
                self.on_dead(e)

    def _fail_all(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(err)
