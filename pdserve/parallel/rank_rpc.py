"""Calls from the engine process into a worker rank, beside the step pipe (the KV transfer's per-rank NIXL
work: registering a rank's pool, loading a producer's agent, READs into a rank's blocks).

A call is a command, a picklable object (a frozen dataclass, one class per command: see
`pdserve.kv_transfer.kv_rank`); the worker runs the handler registered for the command's type. On their own
socketpair the frames are pickled RankCall -> RankReply (the result, or the exception). Calls run
concurrently on the worker (a small thread pool) and complete out of order; every call has a timeout on the
engine side. A call id of None is a one-way notification.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("pdserve.parallel")

Handlers = Mapping[type, Callable[[Any], Any]]  # command class -> what runs a command of that class


@dataclass(frozen=True)
class RankCall:
    """engine -> worker: run `command`; answer with call_id (None: a notification, no answer)."""

    call_id: int | None
    command: Any


@dataclass(frozen=True)
class RankReply:
    """worker -> engine: the handler's result (ok) or the exception it raised."""

    call_id: int
    ok: bool
    value: Any


class RankCallError(RuntimeError):
    """A call into a worker rank failed without a result (the rank is gone, or it raised something that
    does not travel)."""


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives a round trip through pickle, else a RankCallError with its text."""
    try:
        pickle.loads(_dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling problem: send the text instead
        return RankCallError(f"{type(exc).__name__}: {exc}")


class RankClient:
    """The engine's end: `call(command, timeout_s=...)` from any thread."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.rank = rank
        self._conn = conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._closed: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name=f"pdserve-rank{rank}-rpc", daemon=True)
        self._reader.start()

    def call(self, command: Any, *, timeout_s: float) -> Any:
        call_id, fut = self._send(command)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            with self._lock:
                self._pending.pop(call_id, None)
            raise TimeoutError(f"tensor-parallel rank {self.rank}: no answer to {type(command).__name__} "
                               f"within {timeout_s:g} s") from None

    def call_async(self, command: Any) -> Future:
        """Send `command` and return its answer's future at once (the caller bounds the wait: the command
        must end by itself, e.g. by a deadline it carries). Raises RankCallError when the rank is gone."""
        return self._send(command)[1]

    def _send(self, command: Any) -> tuple[int, Future]:
        fut: Future = Future()
        with self._lock:
            if self._closed is not None:
                raise RankCallError(self._closed)
            call_id = next(self._ids)
            self._pending[call_id] = fut
        try:
            with self._send_lock:
                self._conn.send_bytes(_dumps(RankCall(call_id, command)))
        except OSError as e:
            with self._lock:
                self._pending.pop(call_id, None)
            raise RankCallError(f"tensor-parallel rank {self.rank} is gone ({e})") from None
        return call_id, fut

    def notify(self, command: Any) -> None:
        """Fire and forget (best effort: a gone rank is noticed elsewhere)."""
        with contextlib.suppress(OSError), self._send_lock:
            self._conn.send_bytes(_dumps(RankCall(None, command)))

    def _read_loop(self) -> None:
        reason = f"tensor-parallel rank {self.rank} closed its control pipe"
        try:
            while True:
                reply: RankReply = pickle.loads(self._conn.recv_bytes())
                with self._lock:
                    fut = self._pending.pop(reply.call_id, None)
                if fut is None:
                    continue  # its caller timed out
                if reply.ok:
                    fut.set_result(reply.value)
                else:
                    fut.set_exception(reply.value)
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - an undecodable reply ends the channel
            reason = f"tensor-parallel rank {self.rank}: bad reply on the control pipe ({e})"
        with self._lock:
            self._closed = reason
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(RankCallError(reason))

    def close(self) -> None:
        with self._lock:
            self._closed = self._closed or "closed"
        with contextlib.suppress(OSError):
            self._conn.close()


def serve(conn: Connection, handlers: Handlers, max_workers: int = 8) -> None:
    """The worker's end: runs each call's handler (by its command's type) on a thread pool, until the pipe
    closes. Returns then."""
    send_lock = threading.Lock()

    def run(call: RankCall) -> None:
        call_id, command = call.call_id, call.command
        try:
            handler = handlers.get(type(command))
            if handler is None:
                raise RankCallError(f"unknown rank call {type(command).__name__}")
            value = handler(command)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            if call_id is None:
                log.warning("rank notification %s failed: %s", type(command).__name__, e)
                return
            reply = RankReply(call_id, False, _portable(e))
        else:
            if call_id is None:
                return
            reply = RankReply(call_id, True, value)
        with contextlib.suppress(OSError), send_lock:
            conn.send_bytes(_dumps(reply))

    with ThreadPoolExecutor(max_workers, thread_name_prefix="pdserve-rank-rpc") as pool:
        while True:
            try:
                call: RankCall = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            pool.submit(run, call)
