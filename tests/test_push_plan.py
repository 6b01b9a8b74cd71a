"""Push mode's WRITE descriptors (pdserve/kv_transfer/push_plan.py), checked without NIXL: each row is applied
as the byte copy NIXL makes (Nx3: one piece; Nx5: `count` pieces `stride` apart, test_head_split's `_apply`),
and every decode rank's pool must end up holding exactly its KV heads of the blocks it registered, nothing
else, whatever the TP sizes, the pool layout and the layer windows the writer posts. The descriptor counts
are pinned: whole-request push is one row per run of consecutive blocks (the pull path's READ list), a layer
window one strided row per run, never one per (block, layer) slab."""

from __future__ import annotations

import numpy as np
import pytest
from test_head_split import _apply

from pdserve.kv_transfer.head_split import BlockGeometry, block_geometry
from pdserve.kv_transfer.pool import PoolRegion, RemotePool, coalesce_block_runs
from pdserve.kv_transfer.push_plan import plan_rank_writes, write_pairs
from pdserve.kv_transfer.push_sender import _Task, merge_tasks
from pdserve.types.tp_layout import head_sources, kv_head_start, kv_heads_per_rank

LAYERS, BS, HD, BLOCKS = 4, 4, 3, 9
# the decode's blocks 0, 1, 2, 4, 5 <- the prefill's 8, 7, 6 (a descending run), 1, 2; 3, 6, 7, 8 untouched
PREFILL_IDS, DECODE_IDS = [8, 7, 6, 1, 2], [0, 1, 2, 4, 5]
WINDOWS = {"request": [(0, LAYERS)], "layer": [(i, i + 1) for i in range(LAYERS)], "merged": [(0, 1), (1, 4)]}
TP_CASES = [(8, 1, 1), (8, 2, 2), (8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (2, 4, 1), (2, 4, 4), (2, 1, 4),
            (1, 2, 4), (1, 4, 1), (1, 1, 2)]


def _region(pool: np.ndarray) -> PoolRegion:
    return PoolRegion(0, pool.nbytes, BLOCKS, pool.nbytes // BLOCKS, "DRAM", 0, pool.shape, str(pool.dtype))


def _layouts():
    """(name, global KV -> rank pool, empty pool of `heads`, geometry, compat) for the three pool layouts."""
    import torch

    from pdserve.attention import fp8_kv
    from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT

    fmt = fp8_kv.fp8_format("fp8")
    d8 = 16
    return {
        # GPU float pool: [blocks, layers, 2, block, heads, dim], a unit per token row
        "token-major": (lambda g, s, n: np.ascontiguousarray(g[..., s:s + n, :HD]),
                        lambda heads: np.zeros((BLOCKS, LAYERS, 2, BS, heads, HD), np.float32),
                        {"num_layers": LAYERS, "block_size": BS, "head_dim": HD}),
        # CPU float pool: [blocks, layers, 2, heads, block, dim], a unit per (layer, K|V) region
        "head-major": (lambda g, s, n: np.ascontiguousarray(g[..., s:s + n, :HD].transpose(0, 1, 2, 4, 3, 5)),
                       lambda heads: np.zeros((BLOCKS, LAYERS, 2, heads, BS, HD), np.float32),
                       {"num_layers": LAYERS, "block_size": BS, "head_dim": HD, "kv_layout": HEAD_MAJOR_LAYOUT}),
        # fp8 pool: head-major regions of values, then scales
        "fp8": (lambda g, s, n: fp8_kv.quantize_pool(torch.from_numpy(g[..., s:s + n, :d8].copy()), fmt).numpy(),
                lambda heads: np.zeros((BLOCKS, LAYERS, 2, BS, heads, d8 + 2), np.uint8),
                {"num_layers": LAYERS, "block_size": BS, "head_dim": d8, "kv_scales": fp8_kv.SCALE_SCHEME}),
    }


def _expected_rows(runs, windows, segments: int, fields: int, upl: int, whole: bool) -> int:
    rows = 0
    for lo, hi in windows:
        for _, _, n in runs:
            if whole:
                rows += 1
            elif (lo, hi) == (0, LAYERS):
                rows += segments * fields
            else:
                rows += segments * fields * min((hi - lo) * upl, n)
    return rows


@pytest.mark.parametrize("layout", ["token-major", "head-major", "fp8"])
@pytest.mark.parametrize("mode", list(WINDOWS))
@pytest.mark.parametrize(("kv_heads", "src_tp", "dst_tp"), TP_CASES)
def test_every_decode_rank_gets_exactly_its_heads_in_few_descriptors(layout, mode, kv_heads, src_tp, dst_tp):
    to_pool, empty, compat = _layouts()[layout]
    rng = np.random.default_rng(kv_heads * 100 + src_tp * 10 + dst_tp)
    global_kv = rng.standard_normal((BLOCKS, LAYERS, 2, BS, kv_heads, 16)).astype(np.float32)

    def rank_pool(rank: int, tp: int) -> np.ndarray:
        return to_pool(global_kv, kv_head_start(rank, tp, kv_heads), kv_heads_per_rank(tp, kv_heads))

    prefill = [rank_pool(r, src_tp) for r in range(src_tp)]
    decode = [empty(kv_heads_per_rank(dst_tp, kv_heads)) for _ in range(dst_tp)]
    dst_heads = kv_heads_per_rank(dst_tp, kv_heads)
    geometry = block_geometry(compat, decode[0].nbytes // BLOCKS, dst_heads)
    remotes = [RemotePool(0, p.nbytes, "DRAM", 0, p.nbytes // BLOCKS, BLOCKS) for p in decode]
    runs = coalesce_block_runs(PREFILL_IDS, DECODE_IDS)
    writes = []
    for window in WINDOWS[mode]:
        writes += plan_rank_writes(runs, layers=window, num_layers=LAYERS, geometry=geometry, num_kv_heads=kv_heads,
                                   local=[_region(p) for p in prefill], remote=remotes)
    for w in writes:
        _apply(decode[w.dst_rank], prefill[w.src_rank], w.remote_descs, w.local_descs)  # decode <- prefill
    for d in range(dst_tp):
        np.testing.assert_array_equal(decode[d][DECODE_IDS], rank_pool(d, dst_tp)[PREFILL_IDS])
        assert not decode[d][[3, 6, 7, 8]].any()  # nothing outside the registered blocks
    # each head of each decode rank written once (a replicated head too): exactly the registered bytes
    assert sum(w.nbytes for w in writes) == len(DECODE_IDS) * sum(p.nbytes // BLOCKS for p in decode)
    assert {(w.src_rank, w.dst_rank) for w in writes} == {(s, d) for s, ds in
                                                          write_pairs(kv_heads, src_tp, dst_tp).items() for d in ds}
    upl = geometry.units_per_block // LAYERS
    for d in range(dst_tp):
        for s in range(src_tp):
            segs = [g for g in head_sources(kv_heads, d, dst_tp, src_tp) if g.src_rank == s]
            if not segs:
                continue
            whole = len(segs) == 1 and segs[0].count == kv_heads_per_rank(src_tp, kv_heads) == dst_heads
            rows = sum(w.num_descriptors for w in writes if (w.src_rank, w.dst_rank) == (s, d))
            assert rows == _expected_rows(runs, WINDOWS[mode], len(segs), len(geometry.field_head_bytes), upl, whole)


def test_the_8b_shape_at_8k_tokens_is_one_descriptor_a_run_not_one_a_slab() -> None:
    """The H200 case of issue 41: 8k tokens at block 16 = 512 blocks of 32 layers. The old writer made one
    descriptor per (block, layer) slab (16,384, each a separate copy); whole-request push is now the pull
    path's one row per run of consecutive blocks, and per-layer push one strided row per (run, layer)."""
    layers, heads, bs, dim = 32, 8, 16, 128
    block_bytes = layers * 2 * bs * heads * dim * 2  # bf16, token-major
    geometry = BlockGeometry(layers * 2 * bs, (dim * 2,))
    pool = RemotePool(1 << 40, 4096 * block_bytes, "VRAM", 0, block_bytes, 4096)
    runs = coalesce_block_runs(list(range(512)), list(range(1000, 1512)))
    whole = plan_rank_writes(runs, layers=(0, layers), num_layers=layers, geometry=geometry, num_kv_heads=heads,
                             local=[pool], remote=[pool])
    assert [(w.num_descriptors, w.pieces) for w in whole] == [(1, 1)]
    assert whole[0].nbytes == 512 * block_bytes
    per_layer = [w for i in range(layers) for w in plan_rank_writes(
        runs, layers=(i, i + 1), num_layers=layers, geometry=geometry, num_kv_heads=heads, local=[pool],
        remote=[pool])]
    assert sum(w.num_descriptors for w in per_layer) == layers  # one strided row per layer
    assert sum(w.pieces for w in per_layer) == 512 * layers  # a block-major pool: a piece per (block, layer)
    # a writer that fell behind merges ready layers: 4 windows of 8 layers are 4 x 512 pieces
    merged = [w for i in range(0, layers, 8) for w in plan_rank_writes(
        runs, layers=(i, i + 8), num_layers=layers, geometry=geometry, num_kv_heads=heads, local=[pool],
        remote=[pool])]
    assert sum(w.pieces for w in merged) == 512 * 4 and sum(w.nbytes for w in merged) == 512 * block_bytes
    # TP=4 -> TP=4 (the seed's deployment): rank to rank, the same counts per rank pair
    shard = RemotePool(1 << 40, 4096 * block_bytes // 4, "VRAM", 0, block_bytes // 4, 4096)
    tp4 = plan_rank_writes(runs, layers=(0, layers), num_layers=layers, geometry=geometry, num_kv_heads=heads,
                           local=[shard] * 4, remote=[shard] * 4)
    assert [(w.src_rank, w.dst_rank, w.num_descriptors) for w in tp4] == [(r, r, 1) for r in range(4)]


def test_queued_layer_windows_of_the_same_blocks_merge() -> None:
    a, b = object(), object()
    tasks = [_Task(a, 0, 1, 0, 4), _Task(a, 1, 2, 0, 4), _Task(b, 0, 1, 0, 4), _Task(a, 3, 4, 0, 4),
             _Task(a, 2, 3, 0, 4), _Task(a, 0, 1, 4, 5)]  # type: ignore[arg-type]
    merged = {(id(t.job), t.lay_lo, t.lay_hi, t.lo, t.hi, t.count) for t in merge_tasks(tasks)}
    assert merged == {(id(a), 0, 4, 0, 4, 4), (id(b), 0, 1, 0, 4, 1), (id(a), 0, 1, 4, 5, 1)}


def test_a_window_outside_the_layers_is_refused() -> None:
    pool = RemotePool(0, 4096, "DRAM", 0, 512, 8)
    with pytest.raises(ValueError, match="layer window"):
        plan_rank_writes([(0, 0, 1)], layers=(2, 5), num_layers=4, geometry=BlockGeometry(4, (128,)),
                         num_kv_heads=1, local=[pool], remote=[pool])
