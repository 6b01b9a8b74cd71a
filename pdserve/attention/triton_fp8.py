"""fp8 KV blocks inside Triton kernels: the bytes `pdserve.attention.fp8_kv` writes, produced and read on the GPU.

A (block, layer, K|V) region of an fp8 pool holds its fp8 values head-major, [kv_heads, block_size,
head_dim], then their bfloat16 scales [kv_heads, block_size] (fp8_kv's docstring says why). A kernel gets the
layer view `pool[:, layer, 0|1]` and its block stride; `value_offset` and `scale_offset` place a (block,
head, token) in it. Value rows are 16-byte aligned when head_dim is a multiple of 16 and the block stride and
view base are (Triton specializes on both), so K/V tiles load as 16-byte vectors, pipelined with `cp.async`.

The write side must give the same bytes as `fp8_kv.write` (a pool written on the GPU and one written
on the CPU are interchangeable: P/D handoffs between them, prefix-cached blocks, tests that compare them), so
every rounding step is spelled out here instead of left to conversion instructions:

- the scale: amax / fp8_max, divided with IEEE rounding (`div_rn`; Triton's `/` on float32 is approximate),
  clamped to >= 1e-30, then rounded to bfloat16 to nearest even by integer arithmetic;
  or, with a checkpoint's per-tensor k_scale/v_scale, that value (already bfloat16) in every row;
- the values: x / scale (div_rn), clamped to +-fp8_max, then rounded to fp8 to nearest even by integer
  arithmetic (`encode_fp8`). Hardware `cvt` would also round to nearest even on an H200, but Triton's CPU
  interpreter (how CI runs these kernels) truncates in both conversions, which the arithmetic avoids.

The read side converts fp8 -> the compute dtype (exact: every e4m3/e5m2 value is a bfloat16/float16/float32
value) and applies the row's scale outside the matrix products: S = (q . k8) * k_scale per key column, and
P V = (P * v_scale per key column) . v8. So no dequantized K/V tile is ever materialized.
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
    """Byte offset of the value row of (block blk, kv head, token tok of the block) in a layer view."""
    return blk * stride_blk + (head * BLOCK_SIZE + tok) * D


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


# fp8 -> float16 by moving bits, no conversion instructions. Why: on the H200 the fp8 decode kernel with the
# aligned layout was bound by conversions, not memory (b64 x 4k: 310 us vs bf16's 249 us on half the bytes):
# Triton turns fp8 -> bf16 into `cvt.rn.f16x2.e4m3x2` + one `cvt.bf16.f16` per element. Both fp8 formats
# are float16 with fewer bits: e5m2 is float16's top byte (exact), and e4m3 placed as float16 bits
# s.0eeee.mmm0000000 is its value times 2^-8 (subnormals included: e4m3's 0.mmm x 2^-6 lands on float16's
# 0.mmm x 2^-14). So the kernels read K/V as float16 times `f16_unit(FP8_MANT)`^-1 and fold that power of two
# into the row scales; the matrix products run in float16 (queries converted once per program).
# prmt with selector 0x1404 / 0x3424 puts bytes 0, 1 / 2, 3 of $2 into the high byte of each 16-bit half
# (the zero register z fills the low bytes): b << 8 per half, e5m2's float16 bits.
def _e4m3_to_f16_asm(src: str, tail: str) -> str:
    """PTX of the e4m3 decode: the 4 fp8 bytes of operand `src` moved into float16 bit positions (each byte's
    exponent and mantissa shifted right one bit under 0x3F80, its sign kept at 0x8000) as registers t0/s0 and
    t1/s1 (bytes 0, 1 / 2, 3); `tail` combines them into the outputs."""
    return ("{\n.reg .b32 z, h<2>, t<2>, s<2>;\nmov.b32 z, 0;\n"
            f"prmt.b32 h0, {src}, z, 0x1404;\nprmt.b32 h1, {src}, z, 0x3424;\n"
            "shr.b32 t0, h0, 1;\nshr.b32 t1, h1, 1;\n"
            "and.b32 t0, t0, 0x3F803F80;\nand.b32 t1, t1, 0x3F803F80;\n"
            "and.b32 s0, h0, 0x80008000;\nand.b32 s1, h1, 0x80008000;\n" + tail + "}")


_E4M3_TO_F16_ASM = tl.constexpr(_e4m3_to_f16_asm("$2", "or.b32 $0, t0, s0;\nor.b32 $1, t1, s1;\n"))
_E5M2_TO_F16_ASM = tl.constexpr("""{
.reg .b32 z;
mov.b32 z, 0;
prmt.b32 $0, $2, z, 0x1404;
prmt.b32 $1, $2, z, 0x3424;
}""")


def f16_unit(fmt: fp8_kv.Fp8Format) -> float:
    """What a value decoded by `fp8_to_f16` must be multiplied by: 2^8 for e4m3, 1 for e5m2."""
    return 256.0 if _LAYOUT[fmt.name][0] == 3 else 1.0


@triton.jit
def fp8_to_f16(raw, FP8_MANT: tl.constexpr, ASM: tl.constexpr):
    """uint8 fp8 bytes -> float16 (e5m2: the value; e4m3: the value x 2^-8). ASM: packed PTX (4 bytes per
    instruction group, GPU only); else the same bits by integer arithmetic (Triton's CPU interpreter)."""
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
        else:
            bits = b << 8
        return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fp8_tile(raw, dtype: tl.constexpr, FP8_MANT: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr):
    """A loaded K/V tile (uint8 fp8 bytes) as matrix-product input: float16 times 1 / f16_unit with F16 (the
    caller converted q to float16 and multiplies the scales by the unit), else the exact values in `dtype`."""
    if F16:
        return fp8_to_f16(raw, FP8_MANT, ASM)
    else:
        return as_fp8(raw, FP8_MANT).to(dtype)


@triton.jit
def tile_scale_rows(bt_row, tile, seq_len, kvh, stride_blk, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    KVH: tl.constexpr, D: tl.constexpr):
    """Where the scales of tokens [tile * TILE_N, + TILE_N) of KV head kvh live, per block of the tile (TILE_N a
    multiple of BLOCK_SIZE): (byte offsets [NB, 2 * BLOCK_SIZE], mask). A block's BLOCK_SIZE scales of one head
    are 2 * BLOCK_SIZE contiguous bytes: one row per block instead of one 2-byte load per token."""
    NB: tl.constexpr = TILE_N // BLOCK_SIZE
    j = tl.arange(0, NB)
    c = tl.arange(0, 2 * BLOCK_SIZE)
    first = tile * TILE_N + j * BLOCK_SIZE
    blk = tl.load(bt_row + tile * NB + j, mask=first < seq_len, other=0).to(tl.int64)
    row = blk * stride_blk + (KVH * BLOCK_SIZE * D) + kvh.to(tl.int64) * (2 * BLOCK_SIZE)
    return row[:, None] + c[None, :], (first[:, None] + c[None, :] // 2) < seq_len


@triton.jit
def tile_scale_halves(bt_row, tile, seq_len, kvh, stride_blk, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      KVH: tl.constexpr, D: tl.constexpr):
    """tile_scale_rows in bfloat16 units: (offsets [NB, BLOCK_SIZE] from the layer view's base as int16, mask)."""
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


@triton.jit
def load_tile_scales(cache_ptr, offsets, mask, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The scales at `tile_scale_rows`' offsets as float32 [TILE_N] in token order (0 past the sequence)."""
    NB: tl.constexpr = TILE_N // BLOCK_SIZE
    raw = tl.load(cache_ptr + offsets, mask=mask, other=0)
    lo, hi = tl.split(tl.reshape(raw, [NB, BLOCK_SIZE, 2]))
    bits = (hi.to(tl.int32) << 24) | (lo.to(tl.int32) << 16)
    return tl.reshape(bits.to(tl.float32, bitcast=True), [TILE_N])


# The same decode, one 32-bit word (4 fp8 values) in, four float16 out: for tiles decoded where they were
# loaded (`load_tile_f16`), before Triton moves them into a matrix-product operand layout.
_E4M3_TO_F16X4_ASM = tl.constexpr(_e4m3_to_f16_asm("$4", "or.b32 t0, t0, s0;\nor.b32 t1, t1, s1;\n"
                                                     "mov.b32 {$0, $1}, t0;\nmov.b32 {$2, $3}, t1;\n"))
_E5M2_TO_F16X4_ASM = tl.constexpr("""{
.reg .b32 z, h<2>;
mov.b32 z, 0;
prmt.b32 h0, $4, z, 0x1404;
prmt.b32 h1, $4, z, 0x3424;
mov.b32 {$0, $1}, h0;
mov.b32 {$2, $3}, h1;
}""")


@triton.jit
def _byte_to_f16(w, shift: tl.constexpr, FP8_MANT: tl.constexpr):
    b = (w >> shift) & 0xFF
    if FP8_MANT == 3:
        bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    else:
        bits = b << 8
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def load_tile_f16(cache_ptr, row_off, mask, TILE_N: tl.constexpr, D: tl.constexpr, FP8_MANT: tl.constexpr,
                  ASM: tl.constexpr):
    """A [TILE_N, D] fp8 tile (rows at byte offsets row_off, 16-byte aligned) as float16 (x 1 / f16_unit),
    decoded in the layout it was loaded in: 32-bit words, 4 values each, joined back into rows. Why: a V tile
    decoded by `fp8_tile` is first moved into the p.v product's operand layout as bytes (V's rows are the
    product's reduction dimension, and there is no transposing 8-bit shared-memory load on sm_90), which
    Triton does with one `ld.shared.b8` per value (128 per thread for a 128 x 128 tile); decoded here, the
    float16 tile is transposed by `ldmatrix.trans` like a bf16 pool's."""
    w4 = tl.arange(0, D // 4)
    # int32 offsets from an int32 base, so that the 16-byte alignment of the rows stays provable (16-byte
    # cp.async copies), which adding 4 * word to the byte pointer before the cast would hide
    words = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    w = tl.load(words + (row_off // 4)[:, None] + w4[None, :], mask=mask, other=0)
    if ASM:
        if FP8_MANT == 3:
            a, b, c, e = tl.inline_asm_elementwise(_E4M3_TO_F16X4_ASM, "=h,=h,=h,=h,r", [w],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=1)
        else:
            a, b, c, e = tl.inline_asm_elementwise(_E5M2_TO_F16X4_ASM, "=h,=h,=h,=h,r", [w],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=1)
    else:
        a = _byte_to_f16(w, 0, FP8_MANT)
        b = _byte_to_f16(w, 8, FP8_MANT)
        c = _byte_to_f16(w, 16, FP8_MANT)
        e = _byte_to_f16(w, 24, FP8_MANT)
    # join stacks along a new last axis: (a, c) and (b, e) pairs, then those pairs, flatten to a, b, c, e
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, e)), [TILE_N, D])


# q . k on the fp8 tensor cores (Hopper's wgmma takes e4m3 directly, K-major, from shared memory, where K's
# tile already is): no K decode at all. q is split into two e4m3 parts, q / q_scale ~ hi + lo / LO_SCALE,
# which keeps about 8 significant bits (bfloat16's): hi holds the top 4, lo the rounding error of hi. With
# round-to-nearest |error of hi| <= 2^-4 |x|, 16 with a truncating conversion (Triton's CPU interpreter):
# times LO_SCALE = 8 it stays below e4m3's 448 either way.
_Q8_MAX = tl.constexpr(448.0)
_Q8_LO_SCALE = tl.constexpr(8.0)


@triton.jit
def split_e4m3(q):
    """float32 q [G, D] -> (hi, lo e4m3 [G, D], scale [G]) with q ~ (hi + lo / 8) * scale per row."""
    amax = tl.max(tl.abs(q), 1)
    scale = tl.where(amax > 0, amax / _Q8_MAX, 1.0)
    x = q / scale[:, None]
    hi = x.to(tl.float8e4nv)
    lo = ((x - hi.to(tl.float32)) * _Q8_LO_SCALE).to(tl.float8e4nv)
    return hi, lo, scale


@triton.jit
def dot_e4m3_split(k8, q_hi, q_lo):
    """k8 [N, D] e4m3 times the split query (split_e4m3's hi, lo [G, D]): [N, G] float32, before q's scale."""
    s = tl.dot(k8, tl.trans(q_lo)) * (1.0 / _Q8_LO_SCALE)
    return tl.dot(k8, tl.trans(q_hi), s)
