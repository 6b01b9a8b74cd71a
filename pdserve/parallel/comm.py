"""The tensor-parallel group: the collectives the sharded decoder needs, each bounded by a timeout.

A group is a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) built over its own TCPStore, not the
torch.distributed default group: one process may hold several engines (tests, an offline `LLM` next to
another), and nothing global is touched. Rank 0 (the engine process) owns the store.

Timeouts: the group is created with a long setup timeout (the other ranks are still importing torch and
loading weights), then every later collective gets `timeout_s`. A peer that dies closes its sockets, so a
gloo collective fails at once; the timeout is the bound when a peer hangs instead. NCCL's watchdog
enforces the same timeout on CUDA (TORCH_NCCL_ASYNC_ERROR_HANDLING tears the process down then).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def create_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free loopback port (all ranks of a group run on this host)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=_td(timeout_s), wait_for_workers=False)


def connect_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=_td(timeout_s))


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, *, timeout_s: float,
                 setup_timeout_s: float, prefix: str = "tp"):
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout_s = timeout_s
        self.setup_timeout_s = setup_timeout_s
        self._store = store  # the group's connections were set up through it; keep it alive
        prefixed = dist.PrefixStore(prefix, store)
        if device.type == "cuda":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("this torch build has no NCCL: tensor parallelism on CUDA needs it")
            # The watchdog turns a timed-out NCCL collective into an error instead of a hang.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(timeout_s)
            self.backend = "nccl"
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            self.backend = "gloo"
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, _td(setup_timeout_s))
            self.pg.set_timeout(_td(timeout_s))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; returns x."""
        self.pg.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank r's block at columns [r*n, (r+1)*n)."""
        x = x.contiguous()
        if self.backend == "nccl":
            # one flat buffer: capturable in a CUDA graph, and NCCL's fast path
            flat = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            self.pg._allgather_base(flat, x).wait()
            parts = flat.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (sizing the KV pool by the tightest GPU). A setup-time
        collective: the ranks arrive as they finish loading weights, so it waits up to the setup timeout."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.pg.allreduce([t], _min_opts(self.setup_timeout_s)).wait()
        return int(t.item())

    def check_same(self, what: str, value: int) -> None:
        """Raises unless every rank passes the same value (a layout all ranks must agree on)."""
        lo, hi = self.min_int(value), -self.min_int(-value)
        if lo != hi:
            raise RuntimeError(f"tensor-parallel ranks disagree on {what}: {lo} .. {hi}")


def _min_opts(timeout_s: float) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    opts.timeout = _td(timeout_s)
    return opts
