"""Fused elementwise Triton kernels for the GPU decoder path: RMSNorm (with the residual add), RoPE fused
with the K/V store, and SiLU-and-mul; and (from pdserve.engine.runner.gemv) the batch-1 GEMV every linear layer of a
batch-1 decode step uses, with its fused epilogues.

Why fused: a decode step at batch 1 runs ~30 tiny torch kernels per layer for these ops (the float32
RMSNorm alone is 8), ~1000 per step for an 8B model, each a few microseconds even inside a CUDA graph;
that is a large share of a ~4 ms step that should be bound by reading the weights. Each op here is one
kernel. benchmarks/gpu_suite.py measures decode with and without them.

Each kernel rounds where the torch path rounds (HF's op order: normalise in float32, cast, then scale;
silu rounded before the product; RoPE's products rounded before their sum), so the two paths differ
only by summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention import fp8_kv
from pdserve.attention import triton_fp8 as tf8
from pdserve.engine.runner.gemv import (
    gate_up_silu,
    gemv,
    linear,
    linear_add_rms_norm,
    lm_head_argmax,
    new_epilogue_scratch,
    qkv_rope_and_write_kv,
)

__all__ = ["Fp8KvOps", "fused_add_rms_norm", "gate_up_silu", "gemv", "linear", "linear_add_rms_norm",
           "lm_head_argmax", "new_epilogue_scratch", "qkv_rope_and_write_kv", "rms_norm", "rope_and_write_kv",
           "silu_and_mul"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # the residual stream is kept in the activation dtype, as the unfused `x + attn` does
        h = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, h, mask=mask)
        x = h.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, hidden]."""
    x = _rows(x)
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), n, eps,
        HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n), num_warps=_norm_warps(n),
    )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- residual + x (in place); returns (rms_norm(residual) * weight, residual)."""
    x = _rows(x)
    assert residual.stride(-1) == 1
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), n, eps,
        HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n), num_warps=_norm_warps(n),
    )
    return out, residual


def _norm_warps(n: int) -> int:
    return 8 if n >= 4096 else 4 if n >= 1024 else 1


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * n] = [gate | up] -> silu(gate) * up, [rows, n]."""
    x = _rows(x)
    rows, two_n = x.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                        num_warps=4)
    return out


@triton.jit
def _rope_heads(src_ptr, stride_t, stride_h, t, heads, cos, sin, half,
                NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, EVEN: tl.constexpr):
    hmask = heads < NUM_HEADS
    if EVEN:
        mask = hmask[:, None]
    else:
        mask = hmask[:, None] & (half[None, :] < HALF)
    base = src_ptr + t * stride_t + heads[:, None] * stride_h + half[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # rotate-half: out = x * cos + cat(-x2, x1) * sin, each product rounded as the torch path rounds
    o1 = (x1 * cos).to(dt).to(tl.float32) + (-x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt), mask


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, stride_q_t, stride_q_h, k_ptr, stride_k_t, stride_k_h, v_ptr, stride_v_t, stride_v_h,
    cos_ptr, sin_ptr, stride_cs,
    q_out_ptr, stride_qo_t, stride_qo_h,
    k_cache_ptr, v_cache_ptr, stride_c_blk, stride_c_tok, stride_c_head,
    slot_ptr, k_static_scale, v_static_scale,
    H: tl.constexpr, KVH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr, STATIC_SCALE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    EVEN: tl.constexpr = HALF == BLOCK_HALF
    cs_mask = half < HALF
    # cos/sin rows are cat(freqs, freqs): the first half is all we need
    cos = tl.load(cos_ptr + t * stride_cs + half, mask=cs_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_cs + half, mask=cs_mask, other=0.0).to(tl.float32)[None, :]

    qh = tl.arange(0, BLOCK_H)
    q1, q2, qmask = _rope_heads(q_ptr, stride_q_t, stride_q_h, t, qh, cos, sin, half, H, BLOCK_H, HALF, EVEN)
    qo = q_out_ptr + t * stride_qo_t + qh[:, None] * stride_qo_h + half[None, :]
    tl.store(qo, q1, mask=qmask)
    tl.store(qo + HALF, q2, mask=qmask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # padding rows of a CUDA graph carry slot -1
        kh = tl.arange(0, BLOCK_KVH)
        k1, k2, kmask = _rope_heads(k_ptr, stride_k_t, stride_k_h, t, kh, cos, sin, half, KVH, BLOCK_KVH,
                                    HALF, EVEN)
        vsrc = v_ptr + t * stride_v_t + kh[:, None] * stride_v_h + half[None, :]
        v1 = tl.load(vsrc, mask=kmask, other=0.0)
        v2 = tl.load(vsrc + HALF, mask=kmask, other=0.0)
        blk = slot // BLOCK_SIZE
        if KV_FP8:
            # fp8 pool: quantize the rotated (model-dtype-rounded) rows as fp8_kv.write does, into its layout
            kdst = tf8.value_offset(blk, kh, slot % BLOCK_SIZE, stride_c_blk, BLOCK_SIZE, 2 * HALF)[:, None]
            kdst += half[None, :]
            # V is stored dim-major: dim j of the row is BLOCK_SIZE * j bytes after dim 0
            vdst = tf8.v_value_offset(blk, kh, slot % BLOCK_SIZE, stride_c_blk, BLOCK_SIZE, 2 * HALF)[:, None]
            vdst += half[None, :] * BLOCK_SIZE
            srows = tf8.scale_offset(blk, kh, slot % BLOCK_SIZE, stride_c_blk, BLOCK_SIZE, KVH, 2 * HALF)
            _store_fp8_row(k_cache_ptr, srows, kdst, k1.to(tl.float32), k2.to(tl.float32), kmask, kh < KVH, HALF,
                           FP8_MAX, FP8_MANT, FP8_BIAS, FP8_SUB_SCALE, k_static_scale, STATIC_SCALE)
            _store_fp8_row(v_cache_ptr, srows, vdst, v1.to(tl.float32), v2.to(tl.float32), kmask, kh < KVH,
                           HALF * BLOCK_SIZE, FP8_MAX, FP8_MANT, FP8_BIAS, FP8_SUB_SCALE, v_static_scale, STATIC_SCALE)
        else:
            rows = blk * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok + kh * stride_c_head
            dst = rows[:, None] + half[None, :]
            tl.store(k_cache_ptr + dst, k1, mask=kmask)
            tl.store(k_cache_ptr + dst + HALF, k2, mask=kmask)
            tl.store(v_cache_ptr + dst, v1, mask=kmask)
            tl.store(v_cache_ptr + dst + HALF, v2, mask=kmask)


@triton.jit
def _store_fp8_row(cache_ptr, scale_offs, dst, x1, x2, mask, row_mask, SECOND_HALF: tl.constexpr,
                   FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_SUB_SCALE: tl.constexpr,
                   static_scale, STATIC_SCALE: tl.constexpr):
    """Rows given as two halves (masked entries 0): one scale over both (the checkpoint's static one with
    STATIC_SCALE); fp8 values at dst (the first half's) and dst + SECOND_HALF, scales at scale_offs
    (triton_fp8.value_offset / v_value_offset / scale_offset)."""
    if STATIC_SCALE:
        bits = tf8.static_scale_bits(static_scale, scale_offs)
    else:
        bits = tf8.row_scale_bits(tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1)), FP8_MAX)
    scale = bits.to(tl.float32, bitcast=True)[:, None]
    tl.store(cache_ptr + dst, tf8.quantize_values(x1, scale, FP8_MAX, FP8_MANT, FP8_BIAS, FP8_SUB_SCALE),
             mask=mask)
    tl.store(cache_ptr + dst + SECOND_HALF, tf8.quantize_values(x2, scale, FP8_MAX, FP8_MANT, FP8_BIAS, FP8_SUB_SCALE),
             mask=mask)
    tf8.store_scale(cache_ptr + scale_offs, bits, row_mask)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      block_size: int, kv_format: fp8_kv.Fp8Format | None = None,
                      kv_scale: tuple[float, float] | None = None) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (strided views of the fused qkv output are fine); cos/sin: [T, D]
    (rotate-half layout). Returns rotated q, [T, H, D] contiguous; rotated k and v go to their slots
    (quantized to fp8, the bytes fp8_kv.write stores, when kv_format is set; with the static
    (k_scale, v_scale) when kv_scale is given)."""
    num_tokens, num_heads, d = q.shape
    kvh = k.shape[1]
    assert d % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    q_out = torch.empty((num_tokens, num_heads, d), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = d // 2
    _rope_write_kv_kernel[(num_tokens,)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        cos, sin, cos.stride(0),
        q_out, q_out.stride(0), q_out.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slot_mapping, *tf8.static_scale_args(kv_scale),
        H=num_heads, KVH=kvh, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KVH=triton.next_power_of_2(kvh),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_SIZE=block_size,
        **tf8.kernel_args(kv_format), STATIC_SCALE=kv_scale is not None, num_warps=4,
    )
    return q_out


class Fp8KvOps:
    """This module's fused ops for a model whose KV pool holds fp8 blocks: the same, except that
    rope_and_write_kv quantizes. (DecoderLM.fused_ops takes this object where it would take the module.)"""

    def __init__(self, kv_format: fp8_kv.Fp8Format):
        self.kv_format = kv_format
        self.rms_norm = rms_norm
        self.fused_add_rms_norm = fused_add_rms_norm
        self.silu_and_mul = silu_and_mul
        self.linear = linear
        # the batch-1 GEMV epilogues that do not touch the pool (the fused qkv one stores model-dtype rows)
        self.gate_up_silu = gate_up_silu
        self.lm_head_argmax = lm_head_argmax
        self.linear_add_rms_norm = linear_add_rms_norm
        self.new_epilogue_scratch = new_epilogue_scratch

    def rope_and_write_kv(self, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_size, kv_scale=None):
        return rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_size, self.kv_format,
                                 kv_scale)
