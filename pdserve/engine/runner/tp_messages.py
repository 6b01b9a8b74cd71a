"""The step pipe between rank 0 and a tensor-parallel worker rank: one frozen dataclass per message.

    engine -> worker: WorkerInit once, then the steps to replay (CpuStep, UseGpuStepRunner, GraphStep,
                      EagerStep) until Stop
    worker -> engine: Hello after its imports, then Ready or Failed after building its runner

Each message is pickled whole onto the pipe (`send` / `recv`); the receiver dispatches on its type. A new
command is a new class here, so both ends and their readers see every message the pipe carries in one place.
Imports nothing at run time beyond the standard library: a worker unpickles WorkerInit before it imports torch.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pdserve.attention.base import AttentionMetadata
    from pdserve.engine.runner.host_batch import EagerShape
    from pdserve.model.config import ModelConfig
    from pdserve.types.engine_config import EngineConfig


# ---- engine -> worker ------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerInit:
    """What a worker builds its runner from (the first message it reads)."""

    config: EngineConfig
    model_cfg: ModelConfig
    model_dir: Path | None
    rank: int
    size: int
    store_port: int
    device: str  # "cpu" or "cuda:<rank>"
    timeout_s: float
    setup_timeout_s: float
    torch_threads: int | None


@dataclass(frozen=True)
class CpuStep:
    """A CPU step's flattened batch (ModelRunner._run_cpu); `rows` are the rows whose logits rank 0 takes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: list[int]


@dataclass(frozen=True)
class UseGpuStepRunner:
    """Switch to the GPU step runner (before rank 0 does: graph capture runs collectives every rank joins)."""

    simulate_graphs: bool


@dataclass(frozen=True)
class GraphStep:
    """A decode graph step: the graph's batch size, its staged header and the new block-table entries
    (flat index, block id pairs), as GpuStepRunner._replay_graph takes them."""

    size: int
    header: np.ndarray
    updates: list[int]


@dataclass(frozen=True)
class EagerStep:
    """An eager GPU-path step: its segment layout and the staged int64 buffer (GpuStepRunner._eager_device)."""

    shape: EagerShape
    buf: np.ndarray


@dataclass(frozen=True)
class Stop:
    """Leave the step loop and exit."""


StepMessage = CpuStep | UseGpuStepRunner | GraphStep | EagerStep  # what ModelRunner.replay runs


# ---- worker -> engine ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """The worker is up and has imported torch (its runner is being built)."""


@dataclass(frozen=True)
class Ready:
    """The worker's runner is built: it replays steps from now on."""

    num_blocks: int
    pid: int


@dataclass(frozen=True)
class Failed:
    """Building the worker's runner failed; the worker exits after sending this."""

    error: str  # the exception and its traceback


# ---- the wire ---------------------------------------------------------------------------------------
def dumps(msg: object) -> bytes:
    # Plain pickle, not multiprocessing's ForkingPickler: that one would move torch tensors through shared
    # memory file descriptors, which cost more than copying a step's few kilobytes.
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, msg: object) -> None:
    conn.send_bytes(dumps(msg))


def recv(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())
