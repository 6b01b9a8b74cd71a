"""Experimental batch-1 GEMV kernels (y = W x, W [N, K] row-major as nn.Linear stores it), plain and with the
decoder's neighbouring elementwise ops fused into the prologue. Timed against cuBLAS by gpu_kernel_lab.py to
decide whether decode at batch 1 should leave cuBLAS."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    wrow = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + cols0
        w = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
        x = tl.load(x_ptr + cols)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    n, k = w.shape
    assert k % block_k == 0
    _gemv_kernel[(triton.cdiv(n, block_n),)](w, x, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                             num_warps=warps)
    return y


@triton.jit
def _gemv_norm_kernel(w_ptr, x_ptr, res_in_ptr, res_out_ptr, nw_ptr, y_ptr, N, K, stride_w, eps,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KP: tl.constexpr):
    """y = W @ rmsnorm(x + res) * nw; program 0 also stores x + res (the residual stream) to res_out."""
    pid = tl.program_id(0)
    kk = tl.arange(0, KP)
    kmask = kk < K
    h = (tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
         + tl.load(res_in_ptr + kk, mask=kmask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
    if pid == 0:
        tl.store(res_out_ptr + kk, h, mask=kmask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / K + eps)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    wrow = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + cols0
        w = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
        xs = (tl.load(x_ptr + cols).to(tl.float32) + tl.load(res_in_ptr + cols).to(tl.float32))
        xs = xs.to(x_ptr.dtype.element_ty).to(tl.float32)
        xn = (xs * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * tl.load(nw_ptr + cols).to(tl.float32)
        xn = xn.to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += w.to(tl.float32) * xn[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rmask)


def gemv_norm(w, x, res_in, res_out, nw, y, eps, block_n, block_k, warps):
    n, k = w.shape
    _gemv_norm_kernel[(triton.cdiv(n, block_n),)](w, x, res_in, res_out, nw, y, n, k, w.stride(0), eps,
                                                  BLOCK_N=block_n, BLOCK_K=block_k, KP=triton.next_power_of_2(k),
                                                  num_warps=warps)
    return y


@triton.jit
def _gemv_silu_kernel(w_ptr, gu_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = W @ (silu(gate) * up), gu = [gate | up] of length 2K."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    wrow = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + cols0
        w = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
        g = tl.load(gu_ptr + cols).to(tl.float32)
        u = tl.load(gu_ptr + K + cols).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(gu_ptr.dtype.element_ty).to(tl.float32)
        xa = (a * u).to(gu_ptr.dtype.element_ty).to(tl.float32)
        acc += w.to(tl.float32) * xa[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rmask)


def gemv_silu(w, gu, y, block_n, block_k, warps):
    n, k = w.shape
    _gemv_silu_kernel[(triton.cdiv(n, block_n),)](w, gu, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                                  num_warps=warps)
    return y
