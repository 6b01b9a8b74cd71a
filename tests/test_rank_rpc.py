"""Calls into a worker rank beside its steps (pdserve/parallel/rank_rpc.py), in one process over a real
socketpair: concurrent calls complete out of order, exceptions travel (or their text does), a slow call
times out, and a closed pipe fails pending and later calls instead of hanging them."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest

from pdserve.kv_transfer.errors import TransferFailed
from pdserve.parallel.rank_rpc import RankCallError, RankClient, serve


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickle re-creates it with one argument: fails
        super().__init__(f"{a}/{b}")


# the commands of these tests, one class each as the real ones (pdserve.kv_transfer.kv_rank)
@dataclass(frozen=True)
class Slow:
    x: int


@dataclass(frozen=True)
class Fast:
    x: int


@dataclass(frozen=True)
class Fail:
    pass


@dataclass(frozen=True)
class Odd:
    pass


@dataclass(frozen=True)
class Note:
    value: float


@dataclass(frozen=True)
class Block:
    pass


def _pair(handlers: dict) -> tuple[RankClient, Connection, threading.Thread]:
    ours, theirs = socket.socketpair()
    worker = Connection(os.dup(theirs.fileno()))
    worker.sock = theirs  # type: ignore[attr-defined]  # kept open (and for shutdown) by the test
    thread = threading.Thread(target=serve, args=(worker, handlers), daemon=True)
    thread.start()
    return RankClient(Connection(ours.detach()), rank=3), worker, thread


def test_calls_results_exceptions_and_timeouts() -> None:
    gate = threading.Event()
    seen: list[float] = []

    def slow(cmd: Slow) -> int:
        gate.wait(5)
        return cmd.x * 2

    def fail(_: Fail) -> None:
        raise TransferFailed("the peer is gone")

    def odd(_: Odd) -> None:
        raise Unpicklable(1, 2)

    client, worker, thread = _pair({Slow: slow, Fast: lambda cmd: cmd.x + 1, Fail: fail, Odd: odd,
                                    Note: lambda cmd: seen.append(cmd.value)})
    try:
        results: list[int] = []
        t = threading.Thread(target=lambda: results.append(client.call(Slow(21), timeout_s=10)))
        t.start()
        assert client.call(Fast(1), timeout_s=5) == 2  # answered while the slow call is still running
        gate.set()
        t.join(10)
        assert results == [42]
        with pytest.raises(TransferFailed, match="the peer is gone"):
            client.call(Fail(), timeout_s=5)
        with pytest.raises(RankCallError, match="Unpicklable: 1/2"):
            client.call(Odd(), timeout_s=5)
        with pytest.raises(RankCallError, match="unknown rank call"):
            client.call(Block(), timeout_s=5)  # no handler for it here
        gate.clear()
        with pytest.raises(TimeoutError, match="rank 3: no answer to Slow within 0.2 s"):
            client.call(Slow(1), timeout_s=0.2)
        gate.set()
        client.notify(Note(1.5))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [1.5]
    finally:
        gate.set()
        client.close()
        worker.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
        thread.join(5)
        worker.close()
        worker.sock.close()  # type: ignore[attr-defined]


def test_a_closed_pipe_fails_pending_and_later_calls() -> None:
    gate = threading.Event()
    client, worker, thread = _pair({Block: lambda _: gate.wait(30)})
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.call(Block(), timeout_s=30)
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.2)
    worker.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]  # the rank dies: its end closes
    t.join(10)
    gate.set()
    assert len(errors) == 1 and isinstance(errors[0], RankCallError)
    with pytest.raises(RankCallError):
        client.call(Block(), timeout_s=1)
    thread.join(5)
    client.close()
    worker.close()
    worker.sock.close()  # type: ignore[attr-defined]


def test_call_async_returns_at_once_and_resolves_later() -> None:
    """`call_async` (a worker rank's push WRITE: the rank waits it out, the engine polls the future): the future
    is pending while the rank works, then holds the result or the exception."""
    gate = threading.Event()

    def slow(cmd: Slow) -> int:
        gate.wait(5)
        return cmd.x * 2

    def fail(_: Fail) -> None:
        raise TransferFailed("the WRITE failed")

    client, worker, _ = _pair({Slow: slow, Fail: fail})
    try:
        fut = client.call_async(Slow(21))
        failed = client.call_async(Fail())
        assert isinstance(failed.exception(timeout=5), TransferFailed)
        assert not fut.done()
        gate.set()
        assert fut.result(timeout=5) == 42
    finally:
        client.close()
        worker.close()
