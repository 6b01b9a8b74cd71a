"""The KV pool as NIXL sees it: one registered region, fixed-size blocks, coalesced descriptors.

The pool is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so block `i` is the byte range
`[base + i*block_bytes, base + (i+1)*block_bytes)` across all layers. A read of many blocks is therefore one
descriptor per block, and one descriptor per run where both the local and the remote ids are consecutive
(each descriptor costs ~6-10 us in NIXL, so this is what makes small blocks fast).
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

POOL_NDIM = 6
# The KV pool's memory: a torch tensor (CPU or CUDA) or a numpy array (tests, CPU tools).
KVPool = Union["torch.Tensor", np.ndarray]  # noqa: UP007 - torch is only imported for type checking


@dataclass(frozen=True)
class PoolRegion:
    base_addr: int
    length: int
    num_blocks: int
    block_bytes: int
    mem_type: str  # "DRAM" | "VRAM" (NIXL names)
    device_id: int  # CUDA device index for VRAM, 0 for DRAM
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16", "float16"

    def describe(self) -> RemotePool:
        """This pool as a peer sees it (the `pool` of a handshake reply or a push registration)."""
        return RemotePool(self.base_addr, self.length, self.mem_type, self.device_id, self.block_bytes,
                          self.num_blocks)


def region_of(pool: KVPool) -> PoolRegion:
    """Describe a contiguous torch tensor (CPU or CUDA) or numpy array holding the KV pool."""
    shape = tuple(int(s) for s in pool.shape)
    if len(shape) != POOL_NDIM:
        raise ValueError(
            f"KV pool must be 6-D [num_blocks, num_layers, 2, block_size and num_kv_heads (either order), head_dim], "
            f"got shape {shape}"
        )
    if shape[2] != 2:
        raise ValueError(f"KV pool dim 2 must be 2 (K and V), got {shape[2]}")
    if isinstance(pool, np.ndarray):
        if not pool.flags.c_contiguous:
            raise ValueError("KV pool must be C-contiguous")
        base, nbytes, dtype = pool.ctypes.data, pool.nbytes, str(pool.dtype)
        mem_type, device_id = "DRAM", 0
    elif hasattr(pool, "data_ptr") and hasattr(pool, "is_contiguous"):
        if not pool.is_contiguous():
            raise ValueError("KV pool tensor must be contiguous")
        base = int(pool.data_ptr())
        nbytes = int(pool.numel()) * int(pool.element_size())
        dtype = str(pool.dtype).removeprefix("torch.")
        if pool.is_cuda:
            mem_type, device_id = "VRAM", int(pool.device.index or 0)
        else:
            mem_type, device_id = "DRAM", 0
    else:
        raise TypeError(f"KV pool must be a torch.Tensor or numpy.ndarray, got {type(pool).__name__}")
    num_blocks = shape[0]
    if num_blocks <= 0 or nbytes == 0:
        raise ValueError("KV pool is empty")
    return PoolRegion(
        base_addr=base,
        length=nbytes,
        num_blocks=num_blocks,
        block_bytes=nbytes // num_blocks,
        mem_type=mem_type,
        device_id=device_id,
        shape=shape,
        dtype=dtype,
    )


def bind_cuda_device(region: PoolRegion) -> None:
    """Make the pool's GPU current in the calling thread (a no-op for DRAM pools).

    UCX's CUDA transports copy with whatever CUDA context is current in the thread that drives NIXL; our load
    workers and the producer's progress thread are fresh threads without one.
    """
    if region.mem_type == "VRAM":
        import torch  # only reached with a CUDA tensor pool, so torch is already loaded

        torch.cuda.set_device(region.device_id)


def pretouch(region: PoolRegion) -> None:
    """Fault in every page of a DRAM pool now rather than during the first transfer into it.

    A READ into never-touched memory costs ~1-5 s per GiB of page faults. Each page's first byte is read and
    written back unchanged, so the pool's contents are preserved.
    """
    if region.mem_type != "DRAM":
        return
    buf = (ctypes.c_uint8 * region.length).from_address(region.base_addr)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:: mmap.PAGESIZE] = arr[:: mmap.PAGESIZE].copy()


class RemotePool(msgspec.Struct, frozen=True):
    """A peer's pool (shard) as its side-channel messages describe it (`messages.py`); a geometry that cannot be
    is refused when the message is decoded."""

    base_addr: int
    length: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    block_bytes: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"remote pool has unknown memory type {self.mem_type!r}")
        if self.block_bytes <= 0 or self.num_blocks <= 0 or self.block_bytes * self.num_blocks > self.length:
            raise ValueError(f"remote pool geometry is inconsistent: {self}")


def check_block_ids(ids: Sequence[int], num_blocks: int, side: str) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids out of range 0..{num_blocks - 1}: {bad[:8]}")


def coalesce_block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair local[i] <- remote[i]; merge runs where both sides step by +1, or both by -1, in lockstep:
    [(first local, first remote, count)] with ascending addresses. A lockstep-descending run is the same
    block-to-block mapping over the same two contiguous regions, so it is one descriptor too (freed blocks
    return to the free list tail-first, so reused ids often come back in descending order)."""
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks for {len(remote_ids)} remote blocks")
    runs: list[list[int]] = []  # [local start, remote start, count, step]
    for lid, rid in zip(local_ids, remote_ids, strict=True):
        lid, rid = int(lid), int(rid)
        if runs:
            run = runs[-1]
            l0, r0, n, step = run
            if n == 1 and lid - l0 == rid - r0 and abs(lid - l0) == 1:
                run[2], run[3] = 2, lid - l0
                continue
            if n > 1 and lid == l0 + step * n and rid == r0 + step * n:
                run[2] += 1
                continue
        runs.append([lid, rid, 1, 1])
    return [(l0, r0, n) if step == 1 else (l0 - n + 1, r0 - n + 1, n) for l0, r0, n, step in runs]


def descriptor_arrays(
    runs: Sequence[tuple[int, int, int]], local: PoolRegion, remote: RemotePool
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (addr, len, device) uint64 arrays for the local and remote side of `runs`."""
    bb = local.block_bytes
    arr = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    lengths = arr[:, 2] * np.uint64(bb)
    local_descs = np.empty((len(runs), 3), dtype=np.uint64)
    local_descs[:, 0] = np.uint64(local.base_addr) + arr[:, 0] * np.uint64(bb)
    local_descs[:, 1] = lengths
    local_descs[:, 2] = np.uint64(local.device_id)
    remote_descs = np.empty((len(runs), 3), dtype=np.uint64)
    remote_descs[:, 0] = np.uint64(remote.base_addr) + arr[:, 1] * np.uint64(bb)
    remote_descs[:, 1] = lengths
    remote_descs[:, 2] = np.uint64(remote.device_id)
    return local_descs, remote_descs
