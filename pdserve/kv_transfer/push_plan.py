"""Push mode's WRITE descriptors: which prefill rank WRITEs which KV heads of which layers of a run of blocks
into which decode rank's registered blocks, in as few descriptors as the layouts allow.

The split by heads is the pull path's (`head_split`): decode rank d takes each of its KV heads from the
producer rank `types.tp_layout.head_sources` names (a head replicated on several prefill ranks comes from
one of them, so it is written once); here the prefill rank is the initiator, so its pool is the local side.

A block of either pool is `num_layers` consecutive per-layer slabs, each `units_per_layer` units of the
block's geometry (`head_split.BlockGeometry`: token rows of a GPU pool, (layer, K|V) regions of a CPU or fp8
pool). A WRITE covers a window of layers [lo, hi) of a run of consecutive block ids (both sides consecutive,
`pool.coalesce_block_runs`):

- same heads on both sides (equal TP, rank to rank; or one replicated head each): every layer of a run is
  one contiguous range, one Nx3 descriptor (whole-request push: exactly the pull path's READ list); a window
  of layers is one piece per block, `stride` = the block, so one Nx5 descriptor per run;
- a slice of heads (different TP): each unit holds the slice as one piece per field (an fp8 pool's values
  and scales), so one Nx5 descriptor per (run, field) for every layer (`stride` = the unit), and for a window
  one per (run, unit of the window, field) with `stride` = the block, or one per (block, field) with
  `stride` = the unit, whichever list is shorter.

NIXL expands an Nx5 row into `count` pieces (`pieces` below): a layer window of a block-major pool can never
be fewer pieces than blocks x windows, which is why the writer merges the windows of layers that are ready
together (`push_sender`) and whole-request push sends each run whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.head_split import BlockGeometry
from pdserve.kv_transfer.pool import PoolRegion, RemotePool
from pdserve.types.tp_layout import HeadSegment, head_sources, kv_heads_per_rank


@dataclass(frozen=True)
class RankWrite:
    """One WRITE: prefill rank `src_rank`'s pool (local side) into decode rank `dst_rank`'s (remote side)."""

    src_rank: int
    dst_rank: int
    local_descs: np.ndarray  # Nx3 (address, length, device) or Nx5 (+ stride, count)
    remote_descs: np.ndarray
    nbytes: int

    @property
    def num_descriptors(self) -> int:
        return int(self.local_descs.shape[0])

    @property
    def pieces(self) -> int:
        """The contiguous copies NIXL makes of it (an Nx5 row is `count` of them)."""
        d = self.local_descs
        return int(d.shape[0]) if d.shape[1] == 3 else int(d[:, 4].sum())


def write_pairs(num_kv_heads: int, src_tp: int, dst_tp: int) -> dict[int, list[int]]:
    """Decode ranks each prefill rank writes to (the agents it must load): the inverse of the pull mapping."""
    pairs: dict[int, list[int]] = {s: [] for s in range(src_tp)}
    for d in range(dst_tp):
        for s in sorted({seg.src_rank for seg in head_sources(num_kv_heads, d, dst_tp, src_tp)}):
            pairs[s].append(d)
    return pairs


def plan_rank_writes(
    runs: Sequence[tuple[int, int, int]],
    *,
    layers: tuple[int, int],
    num_layers: int,
    geometry: BlockGeometry,
    num_kv_heads: int,
    local: Sequence[PoolRegion],
    remote: Sequence[RemotePool],
) -> list[RankWrite]:
    """The WRITEs of layers [lo, hi) of the blocks in `runs` ((prefill start, decode start, count)): one per
    (prefill rank, decode rank) pair that moves heads. `local`: the prefill ranks' pools, `remote`: the decode
    ranks'."""
    lo, hi = layers
    if not 0 <= lo < hi <= num_layers or geometry.units_per_block % num_layers:
        raise ValueError(f"layer window [{lo}, {hi}) of {num_layers} layers")
    src_tp, dst_tp = len(local), len(remote)
    src_heads, dst_heads = kv_heads_per_rank(src_tp, num_kv_heads), kv_heads_per_rank(dst_tp, num_kv_heads)
    for side, pools, heads in (("prefill", local, src_heads), ("decode", remote, dst_heads)):
        for r, pool in enumerate(pools):
            if pool.block_bytes != geometry.block_bytes(heads):
                raise ValueError(f"{side} rank {r} has {pool.block_bytes}-byte blocks, {heads} KV heads take "
                                 f"{geometry.block_bytes(heads)}")
    writes = []
    for d in range(dst_tp):
        by_src: dict[int, list[HeadSegment]] = {}
        for seg in head_sources(num_kv_heads, d, dst_tp, src_tp):
            by_src.setdefault(seg.src_rank, []).append(seg)
        for s, segments in sorted(by_src.items()):
            if len(segments) == 1 and segments[0].count == src_heads == dst_heads:
                ld, rd = _whole(runs, lo, hi, num_layers, local[s], remote[d])
            else:
                ld, rd = _sliced(runs, lo, hi, num_layers, geometry, segments, local[s], src_heads, remote[d],
                                 dst_heads)
            ld, rd = _dense_if_single(ld), _dense_if_single(rd)
            lengths = ld[:, 1] if ld.shape[1] == 3 else ld[:, 1] * ld[:, 4]
            writes.append(RankWrite(s, d, ld, rd, int(lengths.sum())))
    return writes


def _dense_if_single(descs: np.ndarray) -> np.ndarray:
    """Nx5 rows that are all one piece are an Nx3 list (NIXL's plain, cheaper form)."""
    if descs.shape[1] == 5 and descs.shape[0] and bool((descs[:, 4] == 1).all()):
        return np.ascontiguousarray(descs[:, :3])
    return descs


def _whole(runs: Sequence[tuple[int, int, int]], lo: int, hi: int, num_layers: int, src: PoolRegion,
           dst: RemotePool) -> tuple[np.ndarray, np.ndarray]:
    bb = src.block_bytes  # == dst.block_bytes: same heads
    slab = bb // num_layers
    arr = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    out = []
    for pool, col in ((src, 0), (dst, 1)):
        if (lo, hi) == (0, num_layers):  # every layer: a run of blocks is one range
            d = np.empty((len(arr), 3), dtype=np.uint64)
            d[:, 0] = np.uint64(pool.base_addr) + arr[:, col] * np.uint64(bb)
            d[:, 1] = arr[:, 2] * np.uint64(bb)
            d[:, 2] = np.uint64(pool.device_id)
        else:  # the window's slab of each block of the run
            d = np.empty((len(arr), 5), dtype=np.uint64)
            d[:, 0] = np.uint64(pool.base_addr) + arr[:, col] * np.uint64(bb) + np.uint64(lo * slab)
            d[:, 1] = np.uint64((hi - lo) * slab)
            d[:, 2] = np.uint64(pool.device_id)
            d[:, 3] = np.uint64(bb)
            d[:, 4] = arr[:, 2]
        out.append(d)
    return out[0], out[1]


def _sliced(runs: Sequence[tuple[int, int, int]], lo: int, hi: int, num_layers: int, g: BlockGeometry,
            segments: Sequence[HeadSegment], src: PoolRegion, src_heads: int, dst: RemotePool,
            dst_heads: int) -> tuple[np.ndarray, np.ndarray]:
    upl = g.units_per_block // num_layers
    u0, width = lo * upl, (hi - lo) * upl  # the window's units within a block
    full = (lo, hi) == (0, num_layers)
    rows_l: list[tuple[int, int, int, int, int]] = []
    rows_r: list[tuple[int, int, int, int, int]] = []
    for s0, d0, n in runs:
        for seg in segments:
            for f, hb in enumerate(g.field_head_bytes):
                length = seg.count * hb
                # the piece of unit 0 of block 0 of the run, on each side
                a_src = src.base_addr + s0 * src.block_bytes + g.field_offset(f, src_heads) + seg.src_head * hb
                a_dst = dst.base_addr + d0 * dst.block_bytes + g.field_offset(f, dst_heads) + seg.dst_head * hb
                us, ud = g.unit_bytes(src_heads), g.unit_bytes(dst_heads)
                if full:  # every unit of the run, evenly spaced
                    rows_l.append((a_src, length, src.device_id, us, n * g.units_per_block))
                    rows_r.append((a_dst, length, dst.device_id, ud, n * g.units_per_block))
                elif width <= n:  # per unit of the window: that unit of every block of the run
                    for j in range(u0, u0 + width):
                        rows_l.append((a_src + j * us, length, src.device_id, src.block_bytes, n))
                        rows_r.append((a_dst + j * ud, length, dst.device_id, dst.block_bytes, n))
                else:  # per block: the window's units of that block
                    for i in range(n):
                        rows_l.append((a_src + i * src.block_bytes + u0 * us, length, src.device_id, us, width))
                        rows_r.append((a_dst + i * dst.block_bytes + u0 * ud, length, dst.device_id, ud, width))
    return np.asarray(rows_l, dtype=np.uint64).reshape(-1, 5), np.asarray(rows_r, dtype=np.uint64).reshape(-1, 5)
