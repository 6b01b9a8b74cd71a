"""vLLM's KV lane sums on the GPU in one pass: a Triton kernel that reads each byte of each block once.

The hash is vLLM's (vllm/distributed/kv_transfer/kv_connector/v1/nixl/digest.py, `digest_block_pages` and
`merge_digests`): a block is `regions` equal region rows of 8-byte little-endian lanes; per region row
h1 = the sum of its lanes and h2 = the sum of lane * (the lane's index in its row), both wrapped to 64 bits; a
block's digest sums its rows' (h1, h2). The torch reduction in `pdserve.kv_transfer.digest` computes the same
with an index_select copy, a weighted product and two sums (three passes over the blocks); this kernel runs one
program per (block, region row), each streaming its row once, then a [n, regions] sum.

`lanesum_reference` is the plain numpy definition the kernel is tested against (tests/test_kv_digest_gpu.py on
a GPU; tests/test_kv_digest.py checks it on the CPU against vLLM's formula). Only rows of whole lanes are
handled here (`supported`): the digest module keeps the torch path for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

_BLOCK = 1024  # lanes a program loads at a time (8 KiB)


def supported(block_bytes: int, regions: int) -> bool:
    """Whether a block of `block_bytes` splits into `regions` rows of whole 8-byte lanes."""
    return regions > 0 and block_bytes % regions == 0 and (block_bytes // regions) % 8 == 0


def lanesum_reference(rows: np.ndarray, regions: int) -> list[tuple[int, int]]:
    """(h1, h2) of each row of `rows` ([n, block_bytes] uint8), each row `regions` region rows: numpy uint64
    arithmetic, which wraps as vLLM's int64 torch arithmetic does."""
    n, width = rows.shape
    if not supported(width, regions):
        raise ValueError(f"{width}-byte blocks do not split into {regions} rows of whole 8-byte lanes")
    lanes = np.ascontiguousarray(rows).view("<u8").reshape(n, regions, -1)
    index = np.arange(lanes.shape[2], dtype=np.uint64)
    with np.errstate(over="ignore"):
        h1 = lanes.sum(axis=(1, 2), dtype=np.uint64)
        h2 = (lanes * index).sum(axis=(1, 2), dtype=np.uint64)
    return [(int(a), int(b)) for a, b in zip(h1, h2, strict=True)]


def lanesum_triton(pool: torch.Tensor, block_ids: Sequence[int], regions: int) -> list[tuple[int, int]]:
    """(h1, h2) of blocks `block_ids` of a CUDA `pool` ([num_blocks, ...], contiguous, any dtype), its blocks
    `regions` region rows each (`supported` must hold)."""
    import torch

    from pdserve.kv_transfer._lanesum_triton import lanesum_rows_kernel

    if not pool.is_contiguous():
        raise ValueError("the pool must be contiguous")
    lanes = pool.view(torch.uint8).reshape(pool.shape[0], -1).view(torch.int64)
    row_lanes = lanes.shape[1] // regions
    ids = torch.as_tensor([int(b) for b in block_ids], dtype=torch.int64, device=pool.device)
    n = int(ids.numel())
    out = torch.empty((n, regions, 2), dtype=torch.int64, device=pool.device)
    lanesum_rows_kernel[(n, regions)](lanes, ids, out, lanes.shape[1], row_lanes, regions, BLOCK=_BLOCK)
    sums = out.sum(dim=1)  # int64: wraps as uint64 would
    mask = (1 << 64) - 1
    return [(a & mask, b & mask) for a, b in sums.tolist()]
