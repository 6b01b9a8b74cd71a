"""The Triton kernel of `pdserve.kv_transfer.lanesum_kernel` (imported only when a CUDA pool is digested, or under
TRITON_INTERPRET=1 in tests: the CPU torch wheel brings no triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lanesum_rows_kernel(lanes_ptr, ids_ptr, out_ptr, block_lanes, row_lanes, regions, BLOCK: tl.constexpr):
    """Program (i, r): region row r of block ids[i]. out[i, r] = (sum of its int64 lanes, sum of lane * its index
    in the row), wrapped to 64 bits. Each lane is loaded once."""
    i = tl.program_id(0)
    r = tl.program_id(1)
    block = tl.load(ids_ptr + i).to(tl.int64)  # int64 before it meets a stride: block * block_lanes > 2**31
    base = lanes_ptr + block * block_lanes + r.to(tl.int64) * row_lanes
    offs = tl.arange(0, BLOCK).to(tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    acc2 = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, row_lanes, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < row_lanes, other=0)
        acc1 += x
        acc2 += x * idx
    dst = out_ptr + (i.to(tl.int64) * regions + r) * 2
    tl.store(dst, tl.sum(acc1, axis=0))
    tl.store(dst + 1, tl.sum(acc2, axis=0))
