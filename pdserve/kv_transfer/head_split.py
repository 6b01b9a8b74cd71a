"""Reads between pools of different tensor-parallel sizes: which producer ranks a consumer rank reads, and
the descriptors that move exactly its KV heads.

A rank's pool is `[num_blocks, num_layers, 2, block_size, kv_heads_of_rank, head_dim]`. Read as rows, it is
`num_blocks * num_layers * 2 * block_size` rows of `kv_heads_of_rank * head_dim` elements, evenly spaced
over the whole pool, with one block = `num_layers * 2 * block_size` consecutive rows. So:

- same heads on both sides (same TP, rank to rank): whole blocks, one descriptor per run of consecutive
  block ids (`pool.coalesce_block_runs`), as with one rank;
- a slice of heads (different TP): in every row, the bytes of heads [h, h + n) are one piece of
  `n * head_dim * elem` bytes, and the pieces of a run of blocks are evenly spaced on both sides (the row
  sizes). One strided descriptor (NIXL >= 1.5's Nx5 form: address, length, device, stride, count) per run
  and producer rank covers them. The descriptor list stays as short as for whole blocks; NIXL expands each
  into `count` pieces of one row's heads (an fp8 head's inline scale bytes travel with it), which is where
  a layout with heads outside tokens (vLLM's HND) would move block_size times larger pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.pool import PoolRegion, RemotePool, descriptor_arrays
from pdserve.parallel.layout import HeadSegment, head_sources, kv_heads_per_rank


@dataclass(frozen=True)
class RowGeometry:
    """What both sides agree on (the compatibility dict): the rows of a block, and the bytes of one head in
    one row (head_dim elements; an fp8 pool's head also carries its scale bytes)."""

    num_layers: int
    block_size: int
    head_bytes: int

    @property
    def rows_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size

    def block_bytes(self, heads: int) -> int:
        return self.rows_per_block * heads * self.head_bytes


@dataclass(frozen=True)
class RankRead:
    """One READ of a consumer rank: from producer rank `src_rank`, descriptor arrays for both sides."""

    src_rank: int
    local_descs: np.ndarray  # Nx3 (whole blocks) or Nx5 (strided heads)
    remote_descs: np.ndarray
    nbytes: int

    @property
    def num_descriptors(self) -> int:
        return int(self.local_descs.shape[0])


def source_ranks(num_kv_heads: int, dst_rank: int, dst_tp: int, src_tp: int) -> list[int]:
    """The producer ranks a consumer rank reads from (the agents it must know)."""
    return sorted({s.src_rank for s in head_sources(num_kv_heads, dst_rank, dst_tp, src_tp)})


def plan_rank_reads(
    runs: Sequence[tuple[int, int, int]],
    *,
    geometry: RowGeometry,
    num_kv_heads: int,
    dst_rank: int,
    dst_tp: int,
    src_tp: int,
    local: PoolRegion,
    remotes: Sequence[RemotePool],
) -> list[RankRead]:
    """The READs that fill consumer rank `dst_rank`'s heads of the blocks in `runs` ((local start, remote
    start, count), from `pool.coalesce_block_runs`): one per producer rank it reads from."""
    dst_heads = kv_heads_per_rank(dst_tp, num_kv_heads)
    src_heads = kv_heads_per_rank(src_tp, num_kv_heads)
    if local.block_bytes != geometry.block_bytes(dst_heads):
        raise ValueError(f"local pool has {local.block_bytes}-byte blocks, {dst_heads} heads need "
                         f"{geometry.block_bytes(dst_heads)}")
    by_src: dict[int, list[HeadSegment]] = {}
    for seg in head_sources(num_kv_heads, dst_rank, dst_tp, src_tp):
        by_src.setdefault(seg.src_rank, []).append(seg)
    reads = []
    for src_rank, segments in sorted(by_src.items()):
        remote = remotes[src_rank]
        if remote.block_bytes != geometry.block_bytes(src_heads):
            raise ValueError(f"producer rank {src_rank} has {remote.block_bytes}-byte blocks, {src_heads} heads "
                             f"need {geometry.block_bytes(src_heads)}")
        whole = len(segments) == 1 and segments[0].count == src_heads == dst_heads
        if whole:
            local_descs, remote_descs = descriptor_arrays(runs, local, remote)
            nbytes = sum(n for _, _, n in runs) * local.block_bytes
        else:
            local_descs, remote_descs, nbytes = _strided(runs, segments, geometry, local, dst_heads, remote,
                                                         src_heads)
        reads.append(RankRead(src_rank, local_descs, remote_descs, nbytes))
    return reads


def _strided(runs: Sequence[tuple[int, int, int]], segments: Sequence[HeadSegment], g: RowGeometry,
             local: PoolRegion, dst_heads: int, remote: RemotePool,
             src_heads: int) -> tuple[np.ndarray, np.ndarray, int]:
    hb = g.head_bytes
    rows = len(runs) * len(segments)
    local_descs = np.empty((rows, 5), dtype=np.uint64)
    remote_descs = np.empty((rows, 5), dtype=np.uint64)
    nbytes = 0
    i = 0
    for l0, r0, n in runs:
        count = n * g.rows_per_block
        for seg in segments:
            length = seg.count * hb
            local_descs[i] = (local.base_addr + l0 * local.block_bytes + seg.dst_head * hb, length,
                              local.device_id, dst_heads * hb, count)
            remote_descs[i] = (remote.base_addr + r0 * remote.block_bytes + seg.src_head * hb, length,
                               remote.device_id, src_heads * hb, count)
            nbytes += length * count
            i += 1
    return local_descs, remote_descs, nbytes
