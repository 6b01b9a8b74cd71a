"""Linear layers of 2 to 32 rows (a speculative verify step of K + 1 = 5 rows per request at batch 1 to 6; plain
decode at batch 2 to 32) on a Triton kernel that streams each weight tile once for all rows: an experiment,
off unless PDSERVE_SKINNY_GEMM=1 (`ENABLED`).

Why: the batch-1 plain step reads the 8B model's weights through the GEMV kernel (gemv.py, 3.0-4.4 TB/s on
the H200), while a 5-row verify step at batch 1 goes to cuBLAS, whose kernels for a few rows are not made
for a weight stream. Whether this kernel beats cuBLAS there is what `benchmarks/gpu_spec_verify_cost.py
--skinny-ab` measures (same run, graphs recaptured with it on); it stays off by default until an H200 run
says it helps.

One program computes BLOCK_N outputs for every row: per step it loads a [BLOCK_N, BLOCK_K] weight tile and
the rows' [BLOCK_M, BLOCK_K] inputs (rows padded to 16 or 32 for the tensor cores) and accumulates in
float32; the result is rounded to the input dtype, as cuBLAS's is.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("PDSERVE_SKINNY_GEMM", "0") == "1"
MAX_ROWS = 32
BLOCK_K = 256


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    xp = x_ptr + rm[:, None] * stride_x + rk[None, :]
    wp = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (skinny_weight checks it)
        x = tl.load(xp + k0, mask=mmask[:, None], other=0.0)
        w = tl.load(wp + k0, mask=nmask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def skinny_weight(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor | None:
    """The layer's weight where this kernel applies to x (ENABLED, 2..32 rows of 16-bit values, K a multiple of
    BLOCK_K), else None."""
    weight = getattr(layer, "weight", None)
    if (not ENABLED or x.dim() != 2 or not 2 <= x.shape[0] <= MAX_ROWS or not isinstance(weight, torch.Tensor)
            or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype
            or weight.stride(-1) != 1 or x.shape[1] % BLOCK_K != 0):
        return None
    return weight


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype, 1 <= M <= 32, K % BLOCK_K == 0."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS and k % BLOCK_K == 0 and weight.shape[1] == k
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = 32 if n >= 16384 else 16
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=16 if m <= 16 else 32, BLOCK_N=block_n, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None,
        num_warps=4, num_stages=4,
    )
    return y
