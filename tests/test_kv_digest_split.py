"""Block digests across different tensor-parallel sizes (pdserve/kv_transfer/digest_split.py): each consumer rank
digests what it received in the producer's terms, and the checker adds the pieces up to the producer ranks'
digests. Here the ranks' pools are built from one model-wide KV tensor, as `head_split` moves the heads, for
every pool layout (token-major GPU, head-major CPU, fp8 values + scales) and TP pairs with split, gathered and
replicated KV heads: a clean load verifies, and one flipped byte anywhere in any consumer rank is caught. The
real processes (a worker rank answering over rank RPC, NIXL moving the bytes) are in
tests/test_kv_digest_tp_e2e.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.fp8_kv import SCALE_BYTES, SCALE_SCHEME
from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT, POOL_LAYOUT, make_compat
from pdserve.kv_transfer.digest import VLLM_LANESUM, XXH3_128, BlockDigester, DigestMismatch, digest_blocks
from pdserve.kv_transfer.digest_split import SplitLayout, received_digests
from pdserve.kv_transfer.head_split import block_geometry
from pdserve.types.tp_layout import kv_head_start, kv_heads_per_rank

LAYERS, BS, DIM, BLOCKS = 2, 4, 8, 5


def model_kv(layout: str, k: int, seed: int = 0) -> torch.Tensor:
    """One block per row, every KV head of the model, heads on dim 3: [blocks, layers, 2, heads, ...]."""
    g = torch.Generator().manual_seed(seed)
    if layout == "fp8":  # per head: BS * DIM fp8 bytes, then BS bf16 scales
        return torch.randint(0, 256, (BLOCKS, LAYERS, 2, k, BS * (DIM + SCALE_BYTES)), dtype=torch.uint8, generator=g)
    return torch.randn((BLOCKS, LAYERS, 2, k, BS, DIM), generator=g).to(torch.bfloat16)


def rank_pool(kv: torch.Tensor, layout: str, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank` of `tp`'s pool as the engine lays it out, holding its KV heads (replicated below one a rank)."""
    k = kv.shape[3]
    start, n = kv_head_start(rank, tp, k), kv_heads_per_rank(tp, k)
    mine = kv[:, :, :, start:start + n]
    if layout == "token":  # [blocks, layers, 2, block_size, heads, dim]
        return mine.permute(0, 1, 2, 4, 3, 5).contiguous().clone()  # its own memory, whatever the shape
    if layout == "head":  # [blocks, layers, 2, heads, block_size, dim]
        return mine.contiguous().clone()
    values, scales = mine[..., :BS * DIM], mine[..., BS * DIM:]  # a region: every head's values, then scales
    region = torch.cat([values.reshape(BLOCKS, LAYERS, 2, -1), scales.reshape(BLOCKS, LAYERS, 2, -1)], dim=3)
    return region.reshape(BLOCKS, LAYERS, 2, BS, n, DIM + SCALE_BYTES)


def split_layout(layout: str, k: int, tp: int, pool: torch.Tensor) -> SplitLayout:
    compat = make_compat(model="m", dtype="bfloat16", block_size=BS, num_layers=LAYERS, num_kv_heads=k, head_dim=DIM,
                         kv_layout=HEAD_MAJOR_LAYOUT if layout == "head" else POOL_LAYOUT,
                         kv_cache_dtype="fp8_e4m3" if layout == "fp8" else None,
                         kv_scales=SCALE_SCHEME if layout == "fp8" else "none")
    block_bytes = pool[0].numel() * pool.element_size()
    return SplitLayout(block_geometry(compat, block_bytes, kv_heads_per_rank(tp, k)), k, LAYERS * 2)


class InProcessRank:
    """A worker rank's two digest calls over its own pool (the real ones travel over rank RPC: kv_rank)."""

    def __init__(self, pool: torch.Tensor, rank: int) -> None:
        self.pool, self.rank = pool, rank

    def block_digests(self, block_ids, algo):
        return digest_blocks(self.pool, block_ids, algo)

    def received_digests(self, block_ids, algo, layout, dst_tp, src_tp):
        return received_digests(self.pool, block_ids, algo, layout, dst_rank=self.rank, dst_tp=dst_tp, src_tp=src_tp)


def consumer(kv: torch.Tensor, layout: str, tp: int) -> tuple[BlockDigester, list[torch.Tensor]]:
    pools = [rank_pool(kv, layout, r, tp) for r in range(tp)]
    lay = split_layout(layout, kv.shape[3], tp, pools[0])
    return BlockDigester(pools[0], [InProcessRank(p, r) for r, p in enumerate(pools) if r], layout=lay), pools


def producer_digests(kv: torch.Tensor, layout: str, tp: int, algo: str) -> list[list[str]]:
    return [digest_blocks(rank_pool(kv, layout, r, tp), range(BLOCKS), algo) for r in range(tp)]


def flip(pool: torch.Tensor, block: int, offset: int) -> None:
    row = pool[block].view(-1).view(torch.uint8)
    row[offset % row.numel()] ^= 0x21


# (model KV heads, producer TP, consumer TP): heads gathered from several producer ranks, split over several
# consumer ranks, replicated on either side
PAIRS = [(2, 2, 1), (2, 1, 2), (4, 1, 2), (4, 2, 4), (4, 4, 2), (4, 4, 1), (1, 2, 1), (1, 1, 2), (2, 4, 1),
         (2, 1, 4), (2, 4, 2), (2, 2, 4)]
LAYOUTS = ["token", "head", "fp8"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,src_tp,dst_tp", PAIRS)
def test_lanesums_verify_every_byte_across_tp_sizes(layout: str, k: int, src_tp: int, dst_tp: int) -> None:
    kv = model_kv(layout, k)
    expected = producer_digests(kv, layout, src_tp, VLLM_LANESUM)
    local, positions = [1, 2, 4], [0, 1, 3]  # producer blocks 0, 1, 3 landed in local blocks 1, 2, 4
    kv_local = kv.clone()
    kv_local[[1, 2, 4]] = kv[[0, 1, 3]]
    digester, pools = consumer(kv_local, layout, dst_tp)
    assert digester.check(expected, VLLM_LANESUM, src_tp=src_tp, local_ids=local, positions=positions,
                          what="r") is None
    for rank in range(dst_tp):  # a flipped byte anywhere in any rank's received blocks
        for offset in (0, 7, 301, pools[rank][0].numel() * pools[rank].element_size() - 1):
            digester, pools = consumer(kv_local, layout, dst_tp)
            flip(pools[rank], 2, offset)
            with pytest.raises(DigestMismatch, match=r"KV digest mismatch for r: .*block 1 \(local block 2"):
                digester.check(expected, VLLM_LANESUM, src_tp=src_tp, local_ids=local, positions=positions,
                               what="r")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,src_tp,dst_tp", PAIRS)
def test_xxh3_verifies_gathered_producer_ranks_and_says_what_it_cannot(layout: str, k: int, src_tp: int,
                                                                       dst_tp: int) -> None:
    """A consumer rank holding all of a producer rank's heads re-assembles its block and hashes it; a producer
    rank split over consumer ranks is "tp_split" (XXH3 does not add up)."""
    kv = model_kv(layout, k, seed=1)
    expected = producer_digests(kv, layout, src_tp, XXH3_128)
    split = kv_heads_per_rank(src_tp, k) > kv_heads_per_rank(dst_tp, k)
    digester, pools = consumer(kv, layout, dst_tp)
    ids = list(range(BLOCKS))
    assert digester.check(expected, XXH3_128, src_tp=src_tp, local_ids=ids, positions=ids, what="r") == \
        ("tp_split" if split else None)
    if not split:
        for rank in range(dst_tp):
            digester, pools = consumer(kv, layout, dst_tp)
            flip(pools[rank], 3, 123)
            with pytest.raises(DigestMismatch, match=r"block 3 \(local block 3, as consumer rank"):
                digester.check(expected, XXH3_128, src_tp=src_tp, local_ids=ids, positions=ids, what="r")


def test_a_replicated_head_must_arrive_equal_on_every_rank_that_holds_it() -> None:
    kv = model_kv("token", 1)
    expected = producer_digests(kv, "token", 1, VLLM_LANESUM)
    digester, pools = consumer(kv, "token", 2)  # both consumer ranks hold the one KV head
    flip(pools[1], 0, 5)
    with pytest.raises(DigestMismatch, match="head 0 of block 0 .* differs between consumer ranks 0 and 1"):
        digester.check(expected, VLLM_LANESUM, src_tp=1, local_ids=[0], positions=[0], what="r")


def test_without_a_layout_or_with_a_wrong_count_of_rank_lists_nothing_is_verified() -> None:
    kv = model_kv("token", 2)
    expected = producer_digests(kv, "token", 2, VLLM_LANESUM)
    pools = [rank_pool(kv, "token", 0, 1)]
    assert BlockDigester(pools[0]).check(expected, VLLM_LANESUM, src_tp=2, local_ids=[0], positions=[0],
                                         what="r") == "tp_mismatch"
    digester, _ = consumer(kv, "token", 1)
    assert digester.check(expected[:1], VLLM_LANESUM, src_tp=2, local_ids=[0], positions=[0],
                          what="r") == "tp_mismatch"


def test_fields_that_are_not_whole_lanes_are_not_checked_with_lanesums() -> None:
    """fp8 with a block size whose scales are not whole lanes (2 tokens x 2 bytes): nothing adds up, so the
    load says so instead of comparing wrong sums."""
    from pdserve.kv_transfer.head_split import BlockGeometry

    geometry = BlockGeometry(4, (16, 4))
    pool = torch.zeros((2, 2, 2, 2, 2, 10), dtype=torch.uint8)  # 2 heads of (16 + 4) bytes, 4 units
    got = received_digests(pool, [0], VLLM_LANESUM, SplitLayout(geometry, 2, 4), dst_rank=0, dst_tp=1, src_tp=2)
    assert [(r.src_rank, r.src_head, r.digests) for r in got] == [(0, 0, ()), (1, 0, ())]
