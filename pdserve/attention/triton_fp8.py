"""fp8 KV blocks inside Triton kernels: the bytes `pdserve.attention.fp8_kv` writes, produced and read on the GPU.

A (block, layer, K|V) region of an fp8 pool holds its fp8 values head-major, K [kv_heads, block_size,
head_dim] and V dim-major [kv_heads, head_dim, block_size], then their bfloat16 scales [kv_heads, block_size]
(fp8_kv's docstring says why). A kernel gets the layer view `pool[:, layer, 0|1]` and its block stride;
`value_offset` (K), `v_value_offset` (V) and `scale_offset` place a (block, head, token) in it. K rows
(head_dim bytes) and V rows (block_size bytes) are 16-byte aligned when those sizes are multiples of 16 and the
block stride and view base are (Triton specializes on both), so K/V tiles load as 16-byte vectors, pipelined
with `cp.async`.

The write side must give the same bytes as `fp8_kv.write` (a pool written on the GPU and one written
on the CPU are interchangeable: P/D handoffs between them, prefix-cached blocks, tests that compare them), so
every rounding step is spelled out here instead of left to conversion instructions:

- the scale: amax / fp8_max, divided with IEEE rounding (`div_rn`; Triton's `/` on float32 is approximate),
  clamped to >= 1e-30, then rounded to bfloat16 to nearest even by integer arithmetic;
  or, with a checkpoint's per-tensor k_scale/v_scale, that value (already bfloat16) in every row;
- the values: x / scale (div_rn), clamped to +-fp8_max, then rounded to fp8 to nearest even by integer
  arithmetic (`encode_fp8`). Hardware `cvt` would also round to nearest even on an H200, but Triton's CPU
  interpreter (how CI runs these kernels) truncates in both conversions, which the arithmetic avoids.

The read side converts fp8 -> the compute dtype (exact: every e4m3/e5m2 value is a float16/float32 value;
16-bit queries run the products in float16) and applies the row's scale outside the matrix products:
S = (q . k8) * k_scale per key column, and P V = (P * v_scale per key column) . v8. So no dequantized K/V tile
is ever materialized.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.attention import fp8_kv

_LAYOUT = {  # (mantissa bits, exponent bias) of the OCP formats torch calls float8_e4m3fn and float8_e5m2
    "fp8_e4m3": (3, 7),
    "fp8_e5m2": (2, 15),
}


def kernel_args(fmt: fp8_kv.Fp8Format | None) -> dict:
    """The constexprs a kernel that reads or writes a KV cache needs: KV_FP8 False for a float cache."""
    if fmt is None:
        return {"KV_FP8": False, "FP8_MAX": 0.0, "FP8_MANT": 0, "FP8_BIAS": 0, "FP8_SUB_SCALE": 0.0}
    mant, bias = _LAYOUT[fmt.name]
    return {
        "KV_FP8": True,
        "FP8_MAX": fmt.max,
        "FP8_MANT": mant,
        "FP8_BIAS": bias,
        # values below the smallest normal (2^(1 - bias)) are multiples of 2^(1 - bias - mant)
        "FP8_SUB_SCALE": float(2 ** (bias - 1 + mant)),
    }


@triton.jit
def bf16_bits(x):
    """float32 x (positive, finite) -> its bfloat16 rounding to nearest even, as float32 bits (int32)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000 as int32


@triton.jit
def row_scale_bits(amax, FP8_MAX: tl.constexpr):
    """A row's scale from its largest magnitude: bfloat16(max(amax / FP8_MAX, 1e-30)) as float32 bits."""
    return bf16_bits(tl.maximum(tl.math.div_rn(amax, FP8_MAX), 1e-30))


def static_scale_args(kv_scale: tuple[float, float] | None) -> tuple[float, float]:
    """A write kernel's (k, v) static scale arguments: the checkpoint's bfloat16 values, or unused 1.0s
    (the kernel's STATIC_SCALE constexpr is False then). Runtime floats, not constexprs: one compiled
    kernel serves every layer's scales."""
    return (1.0, 1.0) if kv_scale is None else (float(kv_scale[0]), float(kv_scale[1]))


@triton.jit
def static_scale_bits(scale, like):
    """A static scale (float32 holding a bfloat16 value) for every row of `like` ([rows]), as float32 bits
    (int32), the form row_scale_bits gives."""
    return (tl.zeros_like(like).to(tl.float32) + scale).to(tl.int32, bitcast=True)


@triton.jit
def encode_fp8(x, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_SUB_SCALE: tl.constexpr):
    """float32 x with |x| <= the format's max -> fp8 bits (uint8), rounded to nearest even like torch's cast."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - FP8_MANT
    # normal range: drop 23 - mant mantissa bits, rounding to nearest even (a carry bumps the exponent), rebias
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - FP8_BIAS) << FP8_MANT)
    # subnormal range: the count of the smallest steps, rounded by float32 addition of 2^23 (nearest even)
    # (the min keeps the unused lanes of normal values in int32 range)
    steps = (tl.minimum(a.to(tl.float32, bitcast=True), 1.0) * FP8_SUB_SCALE + 8388608.0) - 8388608.0
    code = tl.where(a < ((128 - FP8_BIAS) << 23), steps.to(tl.int32), normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def quantize_values(x, scale, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
                    FP8_SUB_SCALE: tl.constexpr):
    """float32 x / scale (broadcastable float32), clamped to the format's range, as fp8 bits (uint8)."""
    v = tl.math.div_rn(x, scale)
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    return encode_fp8(v, FP8_MANT, FP8_BIAS, FP8_SUB_SCALE)


@triton.jit
def value_offset(blk, head, tok, stride_blk, BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """Byte offset of K's value row of (block blk, kv head, token tok of the block) in a layer view."""
    return blk * stride_blk + (head * BLOCK_SIZE + tok) * D


@triton.jit
def v_value_offset(blk, head, tok, stride_blk, BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """Byte offset of V's value of (block blk, kv head, token tok of the block) at dim 0 in a layer view: V is
    stored dim-major, so dim j of that token is BLOCK_SIZE * j bytes further."""
    return blk * stride_blk + head * (D * BLOCK_SIZE) + tok


@triton.jit
def scale_offset(blk, head, tok, stride_blk, BLOCK_SIZE: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr):
    """Byte offset of that row's bfloat16 scale: after the region's KVH x BLOCK_SIZE x D values."""
    return blk * stride_blk + KVH * BLOCK_SIZE * D + (head * BLOCK_SIZE + tok) * 2


@triton.jit
def store_scale(scale_ptrs, scale_bits, mask):
    """Writes each row's scale (float32 bits of a bfloat16 value) at its two bytes."""
    tl.store(scale_ptrs.to(tl.pointer_type(tl.int16)), (scale_bits >> 16).to(tl.int16), mask=mask)


@triton.jit
def load_scale(scale_ptrs, mask):
    """Each row's bfloat16 scale as float32 (0 where masked)."""
    raw = tl.load(scale_ptrs.to(tl.pointer_type(tl.int16)), mask=mask, other=0)
    return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def as_fp8(raw, FP8_MANT: tl.constexpr):
    """uint8 bytes reinterpreted as the pool's fp8 type (convert with .to(dtype) after)."""
    if FP8_MANT == 3:
        return raw.to(tl.float8e4nv, bitcast=True)
    else:
        return raw.to(tl.float8e5, bitcast=True)


# fp8 -> float16 for 16-bit queries (the products run in float16; queries are converted once per program).
# e4m3: the hardware conversion, `cvt.rn.f16x2.e4m3x2` (sm_89+), two values per instruction. (Until
# 2026-12-02 the kernels moved e4m3 bits into float16 positions with prmt/shift/and, 4 integer operations per
# two values: on the H200 the decode loop was bound by its integer-pipe instructions, and the conversion
# instruction took the most of them off it: BENCHMARKS.md, FP8 KV cache.) e5m2 is float16's top byte, placed
# by one prmt per two values (selector 0x1404 / 0x3424: bytes 0, 1 / 2, 3 of $2 into the high byte of each
# 16-bit half, the zero register z filling the low bytes). Both are exact.
_E4M3_TO_F16_ASM = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")
_E5M2_TO_F16_ASM = tl.constexpr("""{
.reg .b32 z;
mov.b32 z, 0;
prmt.b32 $0, $2, z, 0x1404;
prmt.b32 $1, $2, z, 0x3424;
}""")


@triton.jit
def fp8_to_f16(raw, FP8_MANT: tl.constexpr, ASM: tl.constexpr):
    """uint8 fp8 bytes -> their float16 values (exact). ASM: packed PTX (4 bytes per instruction group, GPU
    only); else integer arithmetic (Triton's CPU interpreter, whose own fp8 conversion flushes e5m2
    subnormals): e5m2 is float16's top byte, and e4m3 moved into float16's bit positions (s.0eeee.mmm0000000)
    is its value x 2^-8, which the multiply by 2^8 makes exact again, subnormals included."""
    if ASM:
        if FP8_MANT == 3:
            return tl.inline_asm_elementwise(_E4M3_TO_F16_ASM, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True,
                                             pack=4)
        else:
            return tl.inline_asm_elementwise(_E5M2_TO_F16_ASM, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True,
                                             pack=4)
    else:
        b = raw.to(tl.int32)
        if FP8_MANT == 3:
            bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
            return bits.to(tl.int16).to(tl.float16, bitcast=True) * 256.0
        else:
            return (b << 8).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fp8_tile(raw, dtype: tl.constexpr, FP8_MANT: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr):
    """A loaded K/V tile (uint8 fp8 bytes) as matrix-product input, exact: float16 with F16 (the caller
    converted q to float16), else `dtype`."""
    if F16:
        return fp8_to_f16(raw, FP8_MANT, ASM)
    else:
        return as_fp8(raw, FP8_MANT).to(dtype)


@triton.jit
def load_v_tile(v_cache_ptr, bt_row, tile, seq_len, kvh, stride_blk, dtype: tl.constexpr, TILE_N: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MANT: tl.constexpr,
                F16: tl.constexpr, ASM: tl.constexpr):
    """V's tokens [tile * TILE_N, + TILE_N) of KV head kvh as the p . v operand [TILE_N, BLOCK_D] (fp8_tile's
    values; 0 past the sequence and past D). With whole blocks per tile the tile is loaded as [blocks, BLOCK_D,
    BLOCK_SIZE], whose BLOCK_SIZE-byte rows are contiguous and 16-byte aligned (16-byte cp.async copies; a
    block id loaded per token would leave Triton no proof that 16 tokens share a block). Past the sequence,
    whole blocks are masked in the load; the last block's tail is read as it is: its probabilities are 0 (the
    scales past the end load as 0), and its bytes are finite, because every byte of an fp8 pool is 0 (pools are
    zero-allocated) or a code a writer stored (clamped to the format's max: never a NaN code, which 0 * NaN
    would turn into a NaN output). Zeroing the tail in the kernel instead cost the decode loop 60 % more
    instructions (a select over the whole tile in the tile that holds the end)."""
    dd = tl.arange(0, BLOCK_D)
    if TILE_N % BLOCK_SIZE == 0:
        NB: tl.constexpr = TILE_N // BLOCK_SIZE
        j = tl.arange(0, NB)
        c = tl.arange(0, BLOCK_SIZE)
        first = tile * TILE_N + j * BLOCK_SIZE
        bmask = first < seq_len
        blk = tl.load(bt_row + tile * NB + j, mask=bmask, other=0).to(tl.int64)
        base = v_value_offset(blk, kvh, 0, stride_blk, BLOCK_SIZE, D)
        ptrs = v_cache_ptr + base[:, None, None] + dd[None, :, None] * BLOCK_SIZE + c[None, None, :]
        if D == BLOCK_D:
            raw = tl.load(ptrs, mask=bmask[:, None, None], other=0)
        else:
            raw = tl.load(ptrs, mask=bmask[:, None, None] & (dd < D)[None, :, None], other=0)
        v = fp8_tile(raw, dtype, FP8_MANT, F16, ASM)  # [NB, BLOCK_D, BLOCK_SIZE]
        return tl.reshape(tl.permute(v, (0, 2, 1)), [TILE_N, BLOCK_D])
    else:  # tiles within one block (block_size > tile): per-token addresses, correct but not vectorized
        n = tl.arange(0, TILE_N)
        tok = tile * TILE_N + n
        tmask = tok < seq_len
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        off = v_value_offset(blk, kvh, tok % BLOCK_SIZE, stride_blk, BLOCK_SIZE, D)
        raw = tl.load(v_cache_ptr + off[:, None] + dd[None, :] * BLOCK_SIZE, mask=tmask[:, None] & (dd < D)[None, :],
                      other=0)
        return fp8_tile(raw, dtype, FP8_MANT, F16, ASM)


@triton.jit
def tile_scale_halves(bt_row, tile, seq_len, kvh, stride_blk, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      KVH: tl.constexpr, D: tl.constexpr):
    """Where the scales of tokens [tile * TILE_N, + TILE_N) of KV head kvh live, per block of the tile (TILE_N a
    multiple of BLOCK_SIZE), in bfloat16 units from the layer view's base: (offsets [NB, BLOCK_SIZE], mask). A
    block's BLOCK_SIZE scales of one head are contiguous: one row per block instead of one load per token."""
    NB: tl.constexpr = TILE_N // BLOCK_SIZE
    j = tl.arange(0, NB)
    c = tl.arange(0, BLOCK_SIZE)
    first = tile * TILE_N + j * BLOCK_SIZE
    blk = tl.load(bt_row + tile * NB + j, mask=first < seq_len, other=0).to(tl.int64)
    row = (blk * stride_blk + (KVH * BLOCK_SIZE * D)) // 2 + kvh.to(tl.int64) * BLOCK_SIZE
    return row[:, None] + c[None, :], (first[:, None] + c[None, :]) < seq_len


@triton.jit
def load_scale_rows(cache_ptr, offsets, mask):
    """The raw scales at `tile_scale_halves`' offsets: int16 [NB, BLOCK_SIZE] (bfloat16 bits, 0 past the
    sequence). Kept raw so that a prefetching loop first uses (converts) them in its next iteration: a load's
    first use is where the thread waits for it."""
    return tl.load(cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + offsets, mask=mask, other=0)


@triton.jit
def scales_from_rows(raw, TILE_N: tl.constexpr):
    """load_scale_rows' int16 [NB, BLOCK_SIZE] as float32 [TILE_N] in token order."""
    return tl.reshape((raw.to(tl.int32) << 16).to(tl.float32, bitcast=True), [TILE_N])
