"""The descriptors of reads between pools of different TP sizes, checked without NIXL: each descriptor row
is applied as the byte copy NIXL would do (Nx3: one piece; Nx5: `count` pieces `stride` apart), and every
consumer rank's pool must end up holding exactly its KV heads of the global KV."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv_transfer.head_split import BlockGeometry, block_geometry, plan_rank_reads, source_ranks
from pdserve.kv_transfer.pool import PoolRegion, RemotePool, coalesce_block_runs
from pdserve.types.tp_layout import kv_head_start, kv_heads_per_rank

LAYERS, BS, HD = 2, 4, 3  # small rows: 2 layers x K/V x 4 tokens, heads of 3 float32 values
GEOM = BlockGeometry(LAYERS * 2 * BS, (HD * 4,))  # a unit per token row, one field of HD float32 per head


def _rank_pool(global_kv: np.ndarray, rank: int, tp: int) -> np.ndarray:
    k = global_kv.shape[4]
    start, n = kv_head_start(rank, tp, k), kv_heads_per_rank(tp, k)
    return np.ascontiguousarray(global_kv[:, :, :, :, start : start + n, :])


def _region(pool: np.ndarray) -> PoolRegion:
    # addresses relative to the pool's own buffer: base 0 (the copies below index bytes of each pool)
    return PoolRegion(0, pool.nbytes, pool.shape[0], pool.nbytes // pool.shape[0], "DRAM", 0, pool.shape, "float32")


def _apply(local: np.ndarray, remote: np.ndarray, local_descs: np.ndarray, remote_descs: np.ndarray) -> None:
    dst, src = local.view(np.uint8).reshape(-1), remote.view(np.uint8).reshape(-1)
    for lrow, rrow in zip(local_descs.tolist(), remote_descs.tolist(), strict=True):
        if len(lrow) == 3:
            (la, length, _), (ra, rlen, _) = lrow, rrow
            assert length == rlen
            dst[la : la + length] = src[ra : ra + length]
            continue
        la, length, _, lstride, count = lrow
        ra, rlen, _, rstride, rcount = rrow
        assert (length, count) == (rlen, rcount) and length <= lstride and length <= rstride
        for i in range(count):
            dst[la + i * lstride : la + i * lstride + length] = src[ra + i * rstride : ra + i * rstride + length]


@pytest.mark.parametrize(("kv_heads", "src_tp", "dst_tp"), [
    (8, 1, 1), (8, 2, 2), (8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (8, 1, 4), (8, 4, 1),
    (2, 4, 1), (2, 4, 2), (2, 1, 4), (2, 4, 4), (1, 2, 4), (1, 4, 1), (1, 1, 2),
])
def test_every_consumer_rank_gets_exactly_its_heads(kv_heads: int, src_tp: int, dst_tp: int) -> None:
    rng = np.random.default_rng(kv_heads * 100 + src_tp * 10 + dst_tp)
    blocks = 9
    global_kv = rng.standard_normal((blocks, LAYERS, 2, BS, kv_heads, HD)).astype(np.float32)
    producers = [_rank_pool(global_kv, r, src_tp) for r in range(src_tp)]
    remotes = [RemotePool(0, p.nbytes, "DRAM", 0, p.nbytes // blocks, blocks) for p in producers]
    # the consumer's blocks 0..5 <- the producer's 8, 7, 6 (a descending run), 1, 2 and 5
    local_ids, remote_ids = [0, 1, 2, 3, 4, 5], [8, 7, 6, 1, 2, 5]
    runs = coalesce_block_runs(local_ids, remote_ids)
    for d in range(dst_tp):
        consumer = np.zeros((blocks, LAYERS, 2, BS, kv_heads_per_rank(dst_tp, kv_heads), HD), dtype=np.float32)
        reads = plan_rank_reads(runs, geometry=GEOM, num_kv_heads=kv_heads, dst_rank=d, dst_tp=dst_tp,
                                src_tp=src_tp, local=_region(consumer), remotes=remotes)
        assert sorted(r.src_rank for r in reads) == source_ranks(kv_heads, d, dst_tp, src_tp)
        for read in reads:
            _apply(consumer, producers[read.src_rank], read.local_descs, read.remote_descs)
            assert read.num_descriptors <= len(runs) * kv_heads  # a row per run (and head run), never per token
        want = _rank_pool(global_kv, d, dst_tp)[remote_ids]
        np.testing.assert_array_equal(consumer[local_ids], want)
        assert not consumer[6:].any()  # nothing outside the named blocks
        assert sum(r.nbytes for r in reads) == len(local_ids) * consumer.nbytes // blocks
        whole = src_tp == dst_tp or kv_heads_per_rank(src_tp, kv_heads) == kv_heads_per_rank(dst_tp, kv_heads) == 1
        assert all(r.local_descs.shape[1] == (3 if whole else 5) for r in reads)


def test_block_size_mismatch_is_refused() -> None:
    consumer = np.zeros((4, LAYERS, 2, BS, 2, HD), dtype=np.float32)
    bad = RemotePool(0, 4096, "DRAM", 0, 1000, 4)
    with pytest.raises(ValueError, match="producer rank 0 has 1000-byte blocks"):
        plan_rank_reads([(0, 0, 1)], geometry=GEOM, num_kv_heads=2, dst_rank=0, dst_tp=1, src_tp=1,
                        local=_region(consumer), remotes=[bad])


# the consumer's blocks 0, 1, 2, 4 <- the producer's 6, 5 (a descending run), 1, 2; blocks 3, 5, 6 untouched
SPLIT_LOCAL_IDS, SPLIT_REMOTE_IDS = [0, 1, 2, 4], [6, 5, 1, 2]


def _check_head_split(rank_pool, consumer_pool, *, blocks: int, kv_heads: int, src_tp: int, dst_tp: int,
                      compat: dict, geometry: BlockGeometry, descriptors_per_run_head: int,
                      check_bytes: bool) -> None:
    """Producer ranks' pools (`rank_pool(rank, tp)`) read by every consumer rank (`consumer_pool(heads)`, zeros)
    through plan_rank_reads: each gets exactly its heads of the named blocks and nothing else, with at most
    `descriptors_per_run_head` descriptors per run and head (never per token row)."""
    producers = [rank_pool(r, src_tp) for r in range(src_tp)]
    remotes = [RemotePool(0, p.nbytes, "DRAM", 0, p.nbytes // blocks, blocks) for p in producers]
    runs = coalesce_block_runs(SPLIT_LOCAL_IDS, SPLIT_REMOTE_IDS)
    for d_rank in range(dst_tp):
        heads = kv_heads_per_rank(dst_tp, kv_heads)
        consumer = consumer_pool(heads)
        assert block_geometry(compat, consumer.nbytes // blocks, heads) == geometry
        reads = plan_rank_reads(runs, geometry=geometry, num_kv_heads=kv_heads, dst_rank=d_rank, dst_tp=dst_tp,
                                src_tp=src_tp, local=_region(consumer), remotes=remotes)
        for read in reads:
            _apply(consumer, producers[read.src_rank], read.local_descs, read.remote_descs)
            assert read.num_descriptors <= len(runs) * kv_heads * descriptors_per_run_head
        np.testing.assert_array_equal(consumer[SPLIT_LOCAL_IDS], rank_pool(d_rank, dst_tp)[SPLIT_REMOTE_IDS])
        assert not consumer[[3, 5, 6]].any()
        if check_bytes:
            assert sum(r.nbytes for r in reads) == len(SPLIT_LOCAL_IDS) * consumer.nbytes // blocks


@pytest.mark.parametrize(("kv_heads", "src_tp", "dst_tp"), [(4, 1, 2), (4, 2, 1), (4, 2, 2), (2, 2, 4), (8, 4, 2)])
def test_fp8_pools_split_by_head_with_values_and_scales(kv_heads: int, src_tp: int, dst_tp: int) -> None:
    """fp8 pools (pdserve.attention.fp8_kv: per (layer, K|V) region, head-major values then scales): a
    consumer rank ends up with exactly the fp8 blocks its heads would have had, had it written them itself."""
    import torch

    from pdserve.attention import fp8_kv

    fmt, d, blocks = fp8_kv.fp8_format("fp8"), 16, 7
    global_kv = torch.randn(blocks, LAYERS, 2, BS, kv_heads, d, generator=torch.Generator().manual_seed(kv_heads))

    def rank_pool(rank: int, tp: int) -> np.ndarray:
        start, n = kv_head_start(rank, tp, kv_heads), kv_heads_per_rank(tp, kv_heads)
        return fp8_kv.quantize_pool(global_kv[..., start : start + n, :], fmt).numpy()

    _check_head_split(
        rank_pool, lambda heads: np.zeros((blocks, LAYERS, 2, BS, heads, d + 2), dtype=np.uint8),
        blocks=blocks, kv_heads=kv_heads, src_tp=src_tp, dst_tp=dst_tp,
        compat={"num_layers": LAYERS, "block_size": BS, "head_dim": d, "kv_scales": fp8_kv.SCALE_SCHEME},
        geometry=BlockGeometry(LAYERS * 2, (BS * d, BS * 2)),
        descriptors_per_run_head=2,  # values + scales per run, never per row
        check_bytes=True)


@pytest.mark.parametrize(("kv_heads", "src_tp", "dst_tp"), [(4, 1, 2), (4, 2, 1), (8, 4, 2), (2, 1, 4), (8, 2, 2)])
def test_head_major_float_pools_split_by_head(kv_heads: int, src_tp: int, dst_tp: int) -> None:
    """CPU float pools (`[blocks, layers, 2, heads, block_size, head_dim]`): a head's rows of a (layer, K|V)
    region are one run, so a consumer rank reads its heads as one piece per region, never per token row."""
    from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT

    rng = np.random.default_rng(kv_heads * 100 + src_tp * 10 + dst_tp)
    blocks = 7
    global_kv = rng.standard_normal((blocks, LAYERS, 2, kv_heads, BS, HD)).astype(np.float32)

    def rank_pool(rank: int, tp: int) -> np.ndarray:
        start, n = kv_head_start(rank, tp, kv_heads), kv_heads_per_rank(tp, kv_heads)
        return np.ascontiguousarray(global_kv[:, :, :, start : start + n])

    _check_head_split(
        rank_pool, lambda heads: np.zeros((blocks, LAYERS, 2, heads, BS, HD), dtype=np.float32),
        blocks=blocks, kv_heads=kv_heads, src_tp=src_tp, dst_tp=dst_tp,
        compat={"num_layers": LAYERS, "block_size": BS, "head_dim": HD, "kv_layout": HEAD_MAJOR_LAYOUT},
        geometry=BlockGeometry(LAYERS * 2, (BS * HD * 4,)),
        descriptors_per_run_head=1,  # a row per run (and head run), never per token
        check_bytes=False)
