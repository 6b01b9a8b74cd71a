"""Starting a tensor-parallel engine: rank 0 in the engine process, ranks 1..N-1 as worker processes.

    runner = start_tensor_parallel(config, model_cfg, model_dir)   # a ModelRunner (rank 0) with .workers

Rank 0 is the engine's own ModelRunner (vLLM's "driver worker" layout): the scheduler, the sampler and
the KV connector stay in the engine process, as with one rank; each step rank 0 sends the step's staged
inputs to the other ranks (one pickled `tp_messages` step on each rank's pipe) and then runs it itself, the
collectives keeping the ranks in lockstep. Scheduling stays in one place; workers only run steps.

Failure: a worker that dies closes its sockets, so rank 0's next collective fails at once (gloo) or within
the collective timeout (NCCL); `check_alive` (polled by the engine loop) notices a death between steps.
Either way the engine stops and the server exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.engine.runner.model_runner import ModelRunner, resolve_device
from pdserve.engine.runner.tp_messages import (
    Failed,
    Hello,
    Ready,
    StepMessage,
    Stop,
    WorkerInit,
    dumps,
    recv,
    send,
)
from pdserve.kv_transfer.kv_rank import RemoteRankAgent
from pdserve.model.config import ModelConfig
from pdserve.parallel.comm import TPGroup, create_store
from pdserve.parallel.rank_rpc import RankClient
from pdserve.types.engine_config import EngineConfig
from pdserve.types.tp_layout import TensorParallelError, check_tensor_parallel

log = logging.getLogger("pdserve.parallel")

_STOP_WAIT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker rank exited: the engine cannot run another step."""


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """The device of each rank; raises TensorParallelError when there are more ranks than GPUs."""
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise TensorParallelError(f"tensor parallelism runs on cuda or cpu, not {device.type}")
    if device.index not in (None, 0):
        raise TensorParallelError(
            f"with tensor parallelism rank r runs on cuda:r; choose the GPUs with CUDA_VISIBLE_DEVICES "
            f"instead of --device {device}")
    count = torch.cuda.device_count()
    if size > count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise TensorParallelError(
            f"tensor_parallel_size {size} needs {size} GPUs, but {count} "
            f"{'is' if count == 1 else 'are'} visible"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))
    return [torch.device("cuda", r) for r in range(size)]


class TPWorkers:
    """Ranks 1..N-1 of one engine: their processes and step pipes."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.clients: list[RankClient] = []  # calls beside the steps (the KV transfer's per-rank agents)
        self.errors: dict[int, str] = {}  # rank -> what it reported before exiting

    def spawn(self, init: WorkerInit) -> None:
        ours, theirs = socket.socketpair()
        rpc_ours, rpc_theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "pdserve.engine.runner.tp_worker", "--fd", str(theirs.fileno()),
               "--rpc-fd", str(rpc_theirs.fileno()), "--parent", str(os.getpid())]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), rpc_theirs.fileno()), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            rpc_theirs.close()
        self.procs.append(proc)
        conn = Connection(ours.detach())
        self.conns.append(conn)
        self.clients.append(RankClient(Connection(rpc_ours.detach()), init.rank))
        send(conn, init)

    def kv_agents(self, name: str, backends: tuple[str, ...], backend_params: dict, loopback: bool,
                  gpu: bool) -> list[RemoteRankAgent]:
        """Starts every worker rank's NIXL agent over its KV pool (`KVConnector`'s rank_agents)."""
        return [RemoteRankAgent.start(c, f"{name}-tp{c.rank}", backends, backend_params, loopback=loopback, gpu=gpu)
                for c in self.clients]

    def rank_of(self, i: int) -> int:
        return i + 1

    def wait_for(self, kind: type[Hello | Ready], timeout_s: float) -> list[Hello | Ready]:
        """Each worker's next message, which must be a `kind`; raises WorkerDiedError naming the rank that
        died or reported an error, TimeoutError past the deadline."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, Hello | Ready] = {}
        while len(got) < len(self.conns):
            for i, conn in enumerate(self.conns):
                if i in got:
                    continue
                rank = self.rank_of(i)
                try:
                    ready = conn.poll(0.05)
                    msg = recv(conn) if ready else None
                except (EOFError, OSError):
                    raise WorkerDiedError(self._death(i)) from None
                if msg is None:
                    if self.procs[i].poll() is not None:
                        raise WorkerDiedError(self._death(i))
                    continue
                if isinstance(msg, Failed):
                    self.errors[rank] = msg.error
                    raise WorkerDiedError(f"tensor-parallel rank {rank} failed: {msg.error}")
                if not isinstance(msg, kind):
                    raise WorkerDiedError(f"tensor-parallel rank {rank} sent {msg!r}, expected {kind.__name__}")
                got[i] = msg
            if time.monotonic() > deadline and len(got) < len(self.conns):
                missing = [self.rank_of(i) for i in range(len(self.conns)) if i not in got]
                raise TimeoutError(f"tensor-parallel ranks {missing} not {kind.__name__.lower()} within {timeout_s:g} s")
        return [got[i] for i in range(len(self.conns))]

    def report(self) -> str | None:
        """What a failed worker said before exiting, if anything (drains the pipes without blocking)."""
        for i, conn in enumerate(self.conns):
            try:
                while conn.poll(0):
                    msg = recv(conn)
                    if isinstance(msg, Failed):
                        self.errors[self.rank_of(i)] = msg.error
            except (EOFError, OSError):
                continue
        if not self.errors:
            return None
        rank, text = next(iter(self.errors.items()))
        return f"tensor-parallel rank {rank} failed: {text}"

    def _death(self, i: int) -> str:
        proc = self.procs[i]
        code = proc.poll()
        if code is None:
            try:
                code = proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
        return (f"tensor-parallel rank {self.rank_of(i)} (pid {proc.pid}) exited"
                + (f" with status {code}" if code is not None else ""))

    def send_step(self, msg: StepMessage) -> None:
        data = dumps(msg)  # once for every rank
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                raise WorkerDiedError(self._death(i)) from None

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise WorkerDiedError(self._death(i))

    def shutdown(self) -> None:
        """Stop every worker: ask, wait, then kill (bounded)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already gone
                send(conn, Stop())
        deadline = time.monotonic() + _STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait(5.0)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        for client in self.clients:
            client.close()
        self.clients.clear()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel worker pid %d survived SIGKILL", proc.pid)
        self._close_pipes()


def start_tensor_parallel(config: EngineConfig, model_cfg: ModelConfig, model_dir: Path | None) -> ModelRunner:
    """Rank 0's ModelRunner, with ranks 1..N-1 started, loaded and replaying its steps."""
    size = config.tensor_parallel_size
    check_tensor_parallel(size, num_heads=model_cfg.num_heads, num_kv_heads=model_cfg.num_kv_heads,
                          intermediate_size=model_cfg.intermediate_size)
    devices = rank_devices(resolve_device(config.device), size)
    setup_s, timeout_s = config.distributed_setup_timeout_s, config.distributed_timeout_s
    threads = None
    if devices[0].type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // size)  # the ranks share this host's cores
    store = create_store(size, setup_s)
    workers = TPWorkers()
    try:
        for rank in range(1, size):
            workers.spawn(WorkerInit(config, model_cfg, model_dir, rank, size, store.port, str(devices[rank]),
                                     timeout_s, setup_s, threads))
        workers.wait_for(Hello, setup_s)
        group = TPGroup(store, 0, size, devices[0], timeout_s=timeout_s, setup_timeout_s=setup_s)
        runner = ModelRunner(config, model_cfg, model_dir, tp=group)
        workers.wait_for(Ready, setup_s)
    except BaseException as e:
        report = workers.report()
        workers.kill()
        if report is not None and not isinstance(e, WorkerDiedError):
            raise WorkerDiedError(report) from e
        raise
    runner.workers = workers
    runner.set_step_sink(workers.send_step)
    # An offline LLM has no shutdown call: its workers go when the runner is collected, or at exit.
    weakref.finalize(runner, workers.kill)
    log.info("tensor parallelism: %d ranks on %s (rank 0 in this process, workers %s)", size,
             ", ".join(str(d) for d in devices), [p.pid for p in workers.procs])
    return runner
