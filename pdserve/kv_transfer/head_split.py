"""Reads between pools of different tensor-parallel sizes: which producer ranks a consumer rank reads, and
the descriptors that move exactly its KV heads.

A block of a rank's pool is `units_per_block` equal units, each holding every head of the rank in one or
more fields, head after head within a field (`BlockGeometry`):

- a token-major float pool `[num_blocks, num_layers, 2, block_size, kv_heads_of_rank, head_dim]` (GPU): a
  unit is one token row (`num_layers * 2 * block_size` per block) with one field of `head_dim * elem` bytes
  per head;
- a head-major float pool `[num_blocks, num_layers, 2, kv_heads_of_rank, block_size, head_dim]` (CPU): a
  unit is one (layer, K|V) region (`num_layers * 2` per block) with one field of `block_size * head_dim *
  elem` bytes per head;
- an fp8 pool (`pdserve.attention.fp8_kv`, head-major regions): a unit is one (layer, K|V) region
  (`num_layers * 2` per block) with two fields, the values (`block_size * head_dim` bytes per head) and
  then the scales (`block_size * 2` bytes per head).

So:
- same heads on both sides (same TP, rank to rank): whole blocks, one descriptor per run of consecutive
  block ids (`pool.coalesce_block_runs`), as with one rank;
- a slice of heads (different TP): in every unit, each field's bytes of heads [h, h + n) are one piece of
  `n * field_bytes_per_head` bytes, and these pieces of a run of blocks are evenly spaced on both sides (the
  unit sizes). One strided descriptor (NIXL >= 1.5's Nx5 form: address, length, device, stride, count) per
  run, producer rank and field covers them. NIXL expands each into `count` pieces: one token row's heads for
  a 16-bit pool, block_size rows of heads (and their scales) for an fp8 pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT, POOL_LAYOUT, CompatValue
from pdserve.kv_transfer.pool import PoolRegion, RemotePool, descriptor_arrays
from pdserve.types.tp_layout import HeadSegment, head_sources, kv_heads_per_rank


@dataclass(frozen=True)
class BlockGeometry:
    """What both sides agree on (the compatibility dict): the units of a block and, per field of a unit, the
    bytes of one head."""

    units_per_block: int
    field_head_bytes: tuple[int, ...]

    def unit_bytes(self, heads: int) -> int:
        return heads * sum(self.field_head_bytes)

    def field_offset(self, field: int, heads: int) -> int:
        return heads * sum(self.field_head_bytes[:field])

    def block_bytes(self, heads: int) -> int:
        return self.units_per_block * self.unit_bytes(heads)


def block_geometry(compat: Mapping[str, CompatValue], block_bytes: int, heads: int) -> BlockGeometry:
    """The geometry a compatibility dict describes; `block_bytes` / `heads` (one local pool's) give the
    element size of a float pool."""
    layers, block_size = int(compat["num_layers"]), int(compat["block_size"])
    if compat.get("kv_scales", "none") != "none":
        from pdserve.attention import fp8_kv

        if compat["kv_scales"] != fp8_kv.SCALE_SCHEME:
            raise ValueError(f"unknown kv_scales scheme {compat['kv_scales']!r}")
        d = int(compat["head_dim"])
        return BlockGeometry(layers * 2, (block_size * d, block_size * fp8_kv.SCALE_BYTES))
    if compat.get("kv_layout", POOL_LAYOUT) == HEAD_MAJOR_LAYOUT:
        regions = layers * 2
        return BlockGeometry(regions, (block_bytes // (regions * heads),))
    rows = layers * 2 * block_size
    return BlockGeometry(rows, (block_bytes // (rows * heads),))


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
    geometry: BlockGeometry,
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


def _strided(runs: Sequence[tuple[int, int, int]], segments: Sequence[HeadSegment], g: BlockGeometry,
             local: PoolRegion, dst_heads: int, remote: RemotePool,
             src_heads: int) -> tuple[np.ndarray, np.ndarray, int]:
    fields = g.field_head_bytes
    rows = len(runs) * len(segments) * len(fields)
    local_descs = np.empty((rows, 5), dtype=np.uint64)
    remote_descs = np.empty((rows, 5), dtype=np.uint64)
    nbytes = 0
    i = 0
    for l0, r0, n in runs:
        count = n * g.units_per_block
        for seg in segments:
            for f, hb in enumerate(fields):
                length = seg.count * hb
                local_descs[i] = (local.base_addr + l0 * local.block_bytes + g.field_offset(f, dst_heads)
                                  + seg.dst_head * hb, length, local.device_id, g.unit_bytes(dst_heads), count)
                remote_descs[i] = (remote.base_addr + r0 * remote.block_bytes + g.field_offset(f, src_heads)
                                   + seg.src_head * hb, length, remote.device_id, g.unit_bytes(src_heads), count)
                nbytes += length * count
                i += 1
    return local_descs, remote_descs, nbytes
