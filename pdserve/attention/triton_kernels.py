"""Triton kernels for paged attention over the block-contiguous KV pool.

The per-layer caches are strided views `pool[:, layer, 0|1]` of shape [num_blocks, block_size, kv_heads,
head_dim]; only the last dimension is contiguous, so every kernel takes the three outer strides. Block
ids are widened to int64 before they meet a stride: one block spans every layer (~1M elements for an 8B
model), so block * stride overflows int32 past ~2k blocks.

Three kernels:
- `prefill_attention`: varlen causal attention for any mix of sequences whose queries are the last q_len
  of seq_len positions (fresh prefill, chunked prefill, prefix-cache hits, decode rows in a mixed step).
  GQA is packed into the M dimension: one program holds BLOCK_Q query tokens x G query heads of one KV
  head, so each K/V tile is loaded once for the whole group.
- `decode_attention`: one query token per sequence, split-KV (flash-decoding) so that small batches still
  fill the GPU; the number of splits depends only on the batch size, so a CUDA graph can hold it. It is a
  run-time argument, not a constexpr, so every batch size shares one compiled kernel. With
  `rows_per_seq` = R > 1 it is the multi-query decode of a speculative verify step (K + 1 rows per
  sequence, one CUDA graph per (batch, R)): each program holds the R x G rows of its (sequence, kv head), so
  a K/V tile is read once for all of them, and row i sees keys up to its own position
  (`query_positions`, read on the device), causally.
- `write_kv`: stores new K/V rows at their slots; slots < 0 (padding rows of a CUDA graph) are skipped.

Every kernel also takes an fp8 pool (`kv_format`, pdserve.attention.fp8_kv: uint8 regions of head-major fp8
values followed by their bfloat16 scales): write_kv quantizes, the attention kernels dequantize on the fly
(pdserve.attention.triton_fp8). Only the block stride of its layer view is used (in bytes); rows and scales
are placed by `triton_fp8.value_offset` / `scale_offset`, and head_dim comes from q or k.

Everything here needs triton; it is imported only on CUDA (or under TRITON_INTERPRET=1 in tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.attention import fp8_kv
from pdserve.attention import triton_fp8 as tf8

LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 models are the exactness tests' models: tf32 would cost ~3e-4 relative error there.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _has_e4m3_cvt(device_index: int | None) -> bool:
    # once per device: _read_args runs for every layer of every eager step
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _read_args(kv_format: fp8_kv.Fp8Format | None, k_cache: torch.Tensor, head_dim: int,
               q: torch.Tensor | None = None) -> dict:
    """The fp8 constexprs of the read kernels. FP8_F16: 16-bit queries read fp8 K/V as float16
    (triton_fp8.fp8_to_f16, exact: packed PTX on a GPU (FP8_ASM), integer arithmetic under Triton's
    interpreter and for e4m3 before sm_89) and run the products in float16. float32 queries (the exactness tests' models) convert the fp8 values to float32."""
    f16 = False
    if kv_format is not None:  # whole regions (fp8_kv.layer_views' layout) with 16-byte aligned value rows
        assert k_cache.dtype == torch.uint8 and k_cache.shape[-1] == head_dim + fp8_kv.SCALE_BYTES
        assert k_cache[0].is_contiguous()
        f16 = q is not None and q.dtype in (torch.bfloat16, torch.float16)
    args = tf8.kernel_args(kv_format)
    asm = f16 and k_cache.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    if asm and args["FP8_MANT"] == 3:  # the e4m3 conversion instruction exists from sm_89 (Ada, Hopper) on
        asm = _has_e4m3_cvt(k_cache.device.index)
    return {"KV_FP8": args["KV_FP8"], "FP8_MANT": args["FP8_MANT"], "FP8_F16": f16, "FP8_ASM": asm}


# ---------------------------------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    k_cache_ptr, v_cache_ptr, stride_c_blk, stride_c_tok, stride_c_head,
    slot_ptr, k_static_scale, v_static_scale,
    BLOCK_SIZE: tl.constexpr, KVH: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr, STATIC_SCALE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < KVH) & (d[None, :] < D)
    k = tl.load(k_ptr + t * stride_k_t + h[:, None] * stride_k_h + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_v_t + h[:, None] * stride_v_h + d[None, :], mask=mask)
    if KV_FP8:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        hmask = h < KVH
        if STATIC_SCALE:  # the checkpoint's per-tensor scales (bfloat16 values) in every row's slot
            k_bits = tf8.static_scale_bits(k_static_scale, h)
            v_bits = tf8.static_scale_bits(v_static_scale, h)
        else:
            k_bits = tf8.row_scale_bits(tl.max(tl.abs(k), 1), FP8_MAX)
            v_bits = tf8.row_scale_bits(tl.max(tl.abs(v), 1), FP8_MAX)
        k8 = tf8.quantize_values(k, k_bits.to(tl.float32, bitcast=True)[:, None], FP8_MAX, FP8_MANT, FP8_BIAS,
                                 FP8_SUB_SCALE)
        v8 = tf8.quantize_values(v, v_bits.to(tl.float32, bitcast=True)[:, None], FP8_MAX, FP8_MANT, FP8_BIAS,
                                 FP8_SUB_SCALE)
        kdst = tf8.value_offset(blk, h, off, stride_c_blk, BLOCK_SIZE, D)[:, None] + d[None, :]
        vdst = tf8.v_value_offset(blk, h, off, stride_c_blk, BLOCK_SIZE, D)[:, None] + d[None, :] * BLOCK_SIZE
        tl.store(k_cache_ptr + kdst, k8, mask=mask)
        tl.store(v_cache_ptr + vdst, v8, mask=mask)
        srows = tf8.scale_offset(blk, h, off, stride_c_blk, BLOCK_SIZE, KVH, D)
        tf8.store_scale(k_cache_ptr + srows, k_bits, hmask)
        tf8.store_scale(v_cache_ptr + srows, v_bits, hmask)
    else:
        dst = (blk * stride_c_blk + off * stride_c_tok + h * stride_c_head)[:, None] + d[None, :]
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, block_size: int, kv_format: fp8_kv.Fp8Format | None = None,
             kv_scale: tuple[float, float] | None = None) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] (any token/head strides, contiguous last dim). With kv_format,
    the caches are fp8 layer views (uint8) and each row is quantized and stored as fp8_kv.write does (same
    bytes), with the static (k_scale, v_scale) when kv_scale is given."""
    num_tokens, kvh, d = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    if kv_format is not None:
        _read_args(kv_format, k_cache, d)
    _write_kv_kernel[(num_tokens,)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slot_mapping, *tf8.static_scale_args(kv_scale),
        BLOCK_SIZE=block_size, KVH=kvh, BLOCK_H=triton.next_power_of_2(kvh), D=d,
        BLOCK_D=triton.next_power_of_2(d), **tf8.kernel_args(kv_format), STATIC_SCALE=kv_scale is not None,
    )


# ---------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------
# Sizes that vary per step are not specialized (Triton would compile a separate kernel when one is 1).
# stride_bt is the step's block-table width in eager steps: specialising on it (divisible by 16 or
# not) would compile new variants mid-serving, ~1 s each.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, stride_q_t, stride_q_h,
    k_cache_ptr, v_cache_ptr, stride_c_blk, stride_c_tok, stride_c_head,
    block_tables_ptr, stride_bt,
    seq_lens_ptr, qpos_ptr,
    out_ptr, stride_o_t, stride_o_h,
    part_o_ptr, part_lse_ptr, counters_ptr,
    scale_log2, num_splits,
    H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MANT: tl.constexpr, KVH: tl.constexpr, FUSED_MERGE: tl.constexpr,
    MERGE_G: tl.constexpr, MERGE_S: tl.constexpr, FP8_F16: tl.constexpr, FP8_ASM: tl.constexpr,
    NQ: tl.constexpr,
):
    # NQ: query rows per sequence (1: plain decode; > 1: a verify step's rows, row m of the program being
    # query m // G, head m % G, over the rows qpos_ptr gives positions for)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    n_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, n_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    if NQ == 1:
        head = kvh * G + g
        gmask = g < G
        q = tl.load(q_ptr + b * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
    else:
        qi = g // G
        head = kvh * G + g % G
        gmask = qi < NQ
        t_row = (b * NQ + qi).to(tl.int64)  # the row in the step's flattened queries
        # row i sees keys [0, its position]; never past the sequence (a padded row repeats the last position)
        key_limit = tl.load(qpos_ptr + t_row, mask=gmask, other=0).to(tl.int32)
        q = tl.load(q_ptr + t_row[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
    if FP8_F16:  # fp8 K/V read as float16 (triton_fp8.fp8_to_f16): the products run in float16
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_c_head
    SCALE_ROWS: tl.constexpr = KV_FP8 and TILE_N % BLOCK_SIZE == 0
    if SCALE_ROWS:
        # The row scales are too small for Triton's cp.async pipeline (2 bytes per thread), so they are
        # prefetched by hand: each tile's scales are loaded one tile ahead, their block ids two tiles ahead, and
        # kept raw until the iteration that uses them: a load's first use is where the thread waits, and
        # converting them right after the load puts a global load's latency in every iteration (sm_90 PTX: the
        # loaded registers go to st.shared at once).
        s_rows, s_mask = tf8.tile_scale_halves(bt_row, t_start, seq_len, kvh, stride_c_blk, TILE_N, BLOCK_SIZE,
                                               KVH, D)
        k_raw_next = tf8.load_scale_rows(k_cache_ptr, s_rows, s_mask)
        v_raw_next = tf8.load_scale_rows(v_cache_ptr, s_rows, s_mask)
        s_rows, s_mask = tf8.tile_scale_halves(bt_row, t_start + 1, seq_len, kvh, stride_c_blk, TILE_N, BLOCK_SIZE,
                                               KVH, D)
    for tile in range(t_start, t_end):
        if SCALE_ROWS:
            k_scale = tf8.scales_from_rows(k_raw_next, TILE_N)
            v_scale = tf8.scales_from_rows(v_raw_next, TILE_N)
            k_raw_next = tf8.load_scale_rows(k_cache_ptr, s_rows, s_mask)
            v_raw_next = tf8.load_scale_rows(v_cache_ptr, s_rows, s_mask)
            s_rows, s_mask = tf8.tile_scale_halves(bt_row, tile + 2, seq_len, kvh, stride_c_blk, TILE_N,
                                                   BLOCK_SIZE, KVH, D)
        tok = tile * TILE_N + n
        tmask = tok < seq_len
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        if EVEN_D:  # a mask constant along d keeps the 16-byte vector loads
            kv_mask = tmask[:, None]
        else:
            kv_mask = tmask[:, None] & dmask[None, :]
        if KV_FP8:
            # fp8: the matrix products run on the exact fp8 values; each key's scale multiplies its score
            # column, each value's scale its probability column. K rows load 16 bytes wide (offsets are
            # constexpr multiples of D); V is dim-major (triton_fp8.load_v_tile).
            off = tf8.value_offset(blk, kvh, tok % BLOCK_SIZE, stride_c_blk, BLOCK_SIZE, D)
            k = tf8.fp8_tile(tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0), q.dtype,
                             FP8_MANT, FP8_F16, FP8_ASM)
            if not SCALE_ROWS:
                s_off = tf8.scale_offset(blk, kvh, tok % BLOCK_SIZE, stride_c_blk, BLOCK_SIZE, KVH, D)
                k_scale = tf8.load_scale(k_cache_ptr + s_off, tmask)
                v_scale = tf8.load_scale(v_cache_ptr + s_off, tmask)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (k_scale * scale_log2)[None, :]
        else:
            off = blk * stride_c_blk + (tok % BLOCK_SIZE) * stride_c_tok + head_off
            k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if NQ == 1:
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
        else:
            # causal within the step's rows; a row may see no key of a tile (its keys end before it): its max
            # stays -inf, and the exponentials are taken against 0 so that they give 0, not NaN
            s = tl.where(tmask[None, :] & (tok[None, :] <= key_limit[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            v = tf8.load_v_tile(v_cache_ptr, bt_row, tile, seq_len, kvh, stride_c_blk, q.dtype, TILE_N, BLOCK_SIZE,
                                D, BLOCK_D, FP8_MANT, FP8_F16, FP8_ASM)
            p = p * v_scale[None, :]
        else:
            v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A split past the end of a short sequence saw no keys: l_i == 0, its weight in the merge is 0.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if NQ > 1:  # (no fused merge: decode_attention refuses it)
        if num_splits == 1:
            tl.store(out_ptr + t_row[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            row = (t_row * H + head) * num_splits + split  # [B * NQ, H, num_splits] row-major
            tl.store(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=omask)
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            tl.store(part_lse_ptr + row, lse, mask=gmask)
    elif num_splits == 1:
        tl.store(out_ptr + b * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        row = (b * H + head) * num_splits + split  # [B, H, num_splits] row-major
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=gmask)
        if FUSED_MERGE:
            # The last of this (sequence, kv head)'s splits to finish merges them all: no merge kernel.
            # The barrier puts every thread's partial stores before the count (acq_rel at GPU scope, which
            # makes them visible to whichever program counts last); that one resets the counter for the
            # next launch (a CUDA graph replays the same buffer) and reads the partials past L1.
            tl.debug_barrier()
            counter = counters_ptr + b * KVH + kvh
            done = tl.atomic_add(counter, 1)
            if done == num_splits - 1:
                # (on the H200, letting only the splits that saw keys count, with a plain-store reset,
                # measured about the same: 9.1 vs 9.4 us per layer at batch 1, 128-530 keys)
                tl.atomic_xchg(counter, 0)
                tl.debug_barrier()
                active = tl.cdiv(n_tiles, tl.maximum(tiles_per_split, 1))  # splits that saw keys
                _merge_group(part_o_ptr, part_lse_ptr, out_ptr, stride_o_t, stride_o_h, b, kvh * G, active,
                             num_splits, H, G, D, BLOCK_D, MERGE_G, MERGE_S)


@triton.jit
def _merge_group(part_o_ptr, part_lse_ptr, out_ptr, stride_o_t, stride_o_h, b, head0, active, num_splits,
                 H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 MERGE_G: tl.constexpr, MERGE_S: tl.constexpr):
    """Merges splits [0, active) of heads [head0, head0 + G) of sequence b (splits past `active` saw no
    keys), MERGE_S splits per load so that short sequences need one round trip."""
    s = tl.arange(0, MERGE_S)
    g = tl.arange(0, MERGE_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    head = head0 + g
    m_run = tl.full([MERGE_G], float("-inf"), dtype=tl.float32)
    total = tl.zeros([MERGE_G], dtype=tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, active, MERGE_S):
        sm = (s0 + s) < active
        row = (b * H + head[None, :]) * num_splits + s0 + s[:, None]  # [MERGE_S, MERGE_G]
        lmask = sm[:, None] & gmask[None, :]
        lse = tl.load(part_lse_ptr + row, mask=lmask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + row[:, :, None] * BLOCK_D + d[None, None, :],
                    mask=lmask[:, :, None] & (d[None, None, :] < D), other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        w = tl.exp2(lse - m_safe[None, :])  # exp2(-inf) = 0 for empty splits
        alpha = tl.exp2(m_run - m_safe)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 0)
        total = total * alpha + tl.sum(w, 0)
        m_run = m_new
    res = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + b * stride_o_t + head[:, None] * stride_o_h + d[None, :], res.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & (d[None, :] < D))


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_o_t, stride_o_h, num_splits,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * H + h) * num_splits + s
    smask = s < num_splits
    lse = tl.load(part_lse_ptr + row, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(lse - m)  # exp2(-inf) = 0 for empty splits
    o = tl.load(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None] & (d[None, :] < D),
                other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_o_t + h * stride_o_h + d, res.to(out_ptr.dtype.element_ty), mask=d < D)


MAX_DECODE_SPLITS = 32


def new_merge_counters(device: torch.device, capacity: int) -> torch.Tensor:
    """decode_attention's merge counters for up to `capacity` (sequence, kv head) pairs, at rest (zeros)."""
    return torch.zeros(capacity, dtype=torch.int32, device=device)


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int, programs_per_sm: int = 4,
                      max_splits: int = MAX_DECODE_SPLITS) -> int:
    """Splits per (sequence, kv head) so that about `programs_per_sm` programs per SM are in flight.
    Depends only on the batch shape, never on sequence lengths, so a captured CUDA graph stays valid for
    every length."""
    programs = batch * num_kv_heads
    return max(1, min(max_splits, triton.cdiv(programs_per_sm * num_sms, programs)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int, out: torch.Tensor | None = None,
                     tile_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                     kv_format: fp8_kv.Fp8Format | None = None,
                     merge_counters: torch.Tensor | None = None, max_regs: int | None = None,
                     rows_per_seq: int = 1, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D]; block_tables: [B, >= blocks of the longest sequence]; seq_lens: [B] (0 = padding row,
    whose output is 0). Returns [B, H, D] in q's dtype. kv_format: the caches are fp8 layer views (uint8, fp8_kv's layout).
    merge_counters: int32 zeros, at least B * kv_heads (new_merge_counters), kept between launches: the
    splits are merged by the last program of each (sequence, kv head) instead of a second kernel, and the
    counters are left at zero. max_regs: a register cap per thread (Triton's maxnreg), for occupancy.
    rows_per_seq R > 1 (a verify step): q is [B * R, H, D], sequence b's rows b * R .. b * R + R - 1, and row t
    attends keys [0, query_positions[t]] (int64 [B * R]; positions below seq_lens[b]); no fused merge."""
    rows, num_heads, d = q.shape
    batch = rows // rows_per_seq
    assert batch * rows_per_seq == rows and (rows_per_seq == 1 or query_positions is not None)
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    block_d = triton.next_power_of_2(d)
    assert 1 <= num_splits <= MAX_DECODE_SPLITS
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        part_o = torch.empty((rows, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    fused_merge = num_splits > 1 and merge_counters is not None and rows_per_seq == 1
    read = _read_args(kv_format, k_cache, d, q)
    if fused_merge:
        assert merge_counters.dtype == torch.int32 and merge_counters.numel() >= batch * kvh
    _decode_kernel[(batch, kvh, num_splits)](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0),
        seq_lens, query_positions if rows_per_seq > 1 else seq_lens,
        out, out.stride(0), out.stride(1),
        part_o, part_lse, merge_counters if fused_merge else seq_lens,
        scale * LOG2E, num_splits,
        H=num_heads, G=group, BLOCK_G=max(16, triton.next_power_of_2(group * rows_per_seq)), D=d, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE_N=tile_n, DOT_PRECISION=_dot_precision(q.dtype),
        EVEN_D=d == block_d, **read, KVH=kvh, FUSED_MERGE=fused_merge,
        MERGE_G=triton.next_power_of_2(group), MERGE_S=8, NQ=rows_per_seq, num_warps=num_warps,
        num_stages=num_stages, **({} if max_regs is None else {"maxnreg": max_regs}),
    )
    if num_splits > 1 and not fused_merge:
        merge_decode_splits(part_o, part_lse, out)
    return out


def merge_decode_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h] from the splits' partial outputs part_o [B, H, splits, BLOCK_D] (float32) and their log2-sum-exp
    part_lse [B, H, splits] (-inf for a split that saw no keys)."""
    batch, num_heads, num_splits, block_d = part_o.shape
    _decode_merge_kernel[(batch, num_heads)](
        part_o, part_lse, out, out.stride(0), out.stride(1), num_splits,
        H=num_heads, D=out.shape[-1], BLOCK_D=block_d, BLOCK_S=MAX_DECODE_SPLITS, num_warps=4,
    )


# ---------------------------------------------------------------------------------------------------
# prefill (varlen, causal, paged, GQA packed)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _load_rows(ptrs, tmask, dmask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A [TILE_N, D] tile of K or V rows (0 where masked). Masks constant along d keep the 16-byte vector loads;
    full tiles need none at all."""
    if MASKED:
        if EVEN_D:
            return tl.load(ptrs, mask=tmask[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=tmask[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=dmask[None, :], other=0.0)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, kvh, stride_c_blk, stride_c_tok, stride_c_head,
    tile_lo, tile_hi, key_limit, seq_len, scale_log2, d, dmask,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
    FP8_MANT: tl.constexpr, KVH: tl.constexpr, FP8_F16: tl.constexpr, FP8_ASM: tl.constexpr,
):
    head_off = kvh.to(tl.int64) * stride_c_head
    n = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        tok = tile * TILE_N + n
        tmask = tok < seq_len
        if MASKED:
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
        if KV_FP8:  # head-major regions: the offsets are constexpr multiples of D, so K rows load 16 bytes wide
            off = tf8.value_offset(blk, kvh, tok % BLOCK_SIZE, stride_c_blk, BLOCK_SIZE, D)
        else:
            off = blk * stride_c_blk + (tok % BLOCK_SIZE) * stride_c_tok + head_off
        k = _load_rows(k_cache_ptr + off[:, None] + d[None, :], tmask, dmask, MASKED, EVEN_D)
        if KV_FP8:  # exact fp8 values; the row scales multiply score / probability columns
            qk = tl.dot(q, tl.trans(tf8.fp8_tile(k, q.dtype, FP8_MANT, FP8_F16, FP8_ASM)),
                        input_precision=DOT_PRECISION)
            if TILE_N % BLOCK_SIZE == 0:  # whole blocks per tile: one row of scales per block
                s_rows, s_mask = tf8.tile_scale_halves(bt_row, tile, seq_len, kvh, stride_c_blk, TILE_N, BLOCK_SIZE,
                                                       KVH, D)
                k_scale = tf8.scales_from_rows(tf8.load_scale_rows(k_cache_ptr, s_rows, s_mask), TILE_N)
                v_scale = tf8.scales_from_rows(tf8.load_scale_rows(v_cache_ptr, s_rows, s_mask), TILE_N)
            else:
                s_off = tf8.scale_offset(blk, kvh, tok % BLOCK_SIZE, stride_c_blk, BLOCK_SIZE, KVH, D)
                k_scale = tf8.load_scale(k_cache_ptr + s_off, tmask)
                v_scale = tf8.load_scale(v_cache_ptr + s_off, tmask)
            qk = qk * k_scale[None, :]
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            # row r sees keys [0, key_limit[r]] (its own absolute position), never past the sequence
            qk = tl.where((tok[None, :] <= key_limit[:, None]) & tmask[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a fully masked row must not make NaNs
            qk = qk - m_new[:, None]
        else:
            # scale > 0, so the row max commutes with it; the scale and the shift fuse into one FMA
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
            qk = qk * scale_log2 - m_new[:, None]
        p = tl.exp2(qk)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:  # V is dim-major (triton_fp8.load_v_tile)
            p = p * v_scale[None, :]
            v = tf8.load_v_tile(v_cache_ptr, bt_row, tile, seq_len, kvh, stride_c_blk, q.dtype, TILE_N, BLOCK_SIZE,
                                D, BLOCK_D, FP8_MANT, FP8_F16, FP8_ASM)
        else:
            v = _load_rows(v_cache_ptr + off[:, None] + d[None, :], tmask, dmask, MASKED, EVEN_D)
        # rescale first, then let the matrix unit accumulate into acc (no second [M, D] add)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _load_partial(o_ptr, lse_ptr, stride_po_t, stride_po_h, stride_lse_h, q_rows, head, d, row_mask, dmask):
    """A partial attention of these rows (another kernel's, over other keys): (o, lse in log2 units)."""
    o = tl.load(o_ptr + q_rows[:, None] * stride_po_t + head[:, None] * stride_po_h + d[None, :],
                mask=row_mask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + head.to(tl.int64) * stride_lse_h + q_rows, mask=row_mask, other=0.0) * 1.4426950408889634
    return o, lse


@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks", "stride_bt", "stride_lse_h", "p_row0"])
def _prefill_kernel(
    q_ptr, stride_q_t, stride_q_h,
    k_cache_ptr, v_cache_ptr, stride_c_blk, stride_c_tok, stride_c_head,
    block_tables_ptr, stride_bt,
    seq_lens_ptr, qsl_ptr, num_seqs, num_q_blocks,
    out_ptr, stride_o_t, stride_o_h,
    kv_lo_ptr, flags_ptr, p1_o_ptr, p1_lse_ptr, p2_o_ptr, p2_lse_ptr, stride_po_t, stride_po_h, stride_lse_h,
    p_row0, scale_log2,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_PARTIALS: tl.constexpr, KV_FP8: tl.constexpr, FP8_MANT: tl.constexpr, KVH: tl.constexpr,
    FP8_F16: tl.constexpr, FP8_ASM: tl.constexpr,
):
    # Longest q blocks (the last of each causal sequence) first: better tail balance.
    qb_global = num_q_blocks - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    # Sequence i owns q blocks [qsl[i] // BLOCK_Q + i, ...): an upper bound on its first block index that
    # needs no host-side table. Binary search for the last i whose start is <= qb_global.
    # (lo and hi start as int32 tensors: a loop-carried value must not begin as a constexpr)
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start_mid = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if start_mid <= qb_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    qb = qb_global - (q_start // BLOCK_Q + seq)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    qi = m // G
    head = kvh * G + m % G
    q_local = qb * BLOCK_Q + qi
    row_mask = (qi < BLOCK_Q) & (q_local < q_len)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    rmask = row_mask[:, None] & dmask[None, :]
    q_rows = (q_start + q_local).to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys below the block's first query position are visible to every row: no mask there.
    first_pos = ctx + qb * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    key_limit = ctx + q_local  # absolute position of each row's query: it sees keys [0, key_limit]
    kv_lo = 0
    if HAS_PARTIALS:
        # A long chunk (pdserve.attention.long_prefill): a library kernel already attended keys [0, kv_lo)
        # (flag 1: partial 1) and/or the chunk's own keys [ctx, seq_len) causally (flag 2: partial 2).
        # Start from their merge and attend only what is left: [kv_lo, ctx), or [kv_lo, seq_len).
        kv_lo = tl.load(kv_lo_ptr + seq).to(tl.int32)
        flags = tl.load(flags_ptr + seq).to(tl.int32)
        if (flags & 1) != 0:
            acc, m_i = _load_partial(p1_o_ptr, p1_lse_ptr, stride_po_t, stride_po_h, stride_lse_h, q_rows - p_row0, head,
                                     d, row_mask, dmask)
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        if (flags & 2) != 0:
            o2, lse2 = _load_partial(p2_o_ptr, p2_lse_ptr, stride_po_t, stride_po_h, stride_lse_h, q_rows - p_row0,
                                     head,
                                     d, row_mask, dmask)
            m_new = tl.maximum(m_i, lse2)
            alpha = tl.exp2(m_i - m_new)
            beta = tl.exp2(lse2 - m_new)
            acc = acc * alpha[:, None] + o2 * beta[:, None]
            l_i = l_i * alpha + beta
            m_i = m_new
            # own keys done: every row sees exactly the context keys that are left
            first_pos = ctx - 1
            kv_end = ctx
            key_limit = tl.zeros([BLOCK_M], dtype=tl.int32) + (ctx - 1)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    n_lo = kv_lo // TILE_N  # kv_lo is a multiple of TILE_N
    n_full = tl.maximum((first_pos + 1) // TILE_N, n_lo)
    n_all = tl.cdiv(kv_end, TILE_N)
    # (a chunk whose partials covered every key only merges them: it needs no queries)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=rmask & (n_all > n_lo), other=0.0)
    if FP8_F16:  # fp8 K/V read as float16 (triton_fp8.fp8_to_f16): the products run in float16
        q = q.to(tl.float16)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, kvh, stride_c_blk, stride_c_tok, stride_c_head,
        n_lo, n_full, key_limit, seq_len, scale_log2, d, dmask,
        False, EVEN_D, BLOCK_SIZE, TILE_N, DOT_PRECISION, D, BLOCK_D, KV_FP8, FP8_MANT, KVH, FP8_F16, FP8_ASM,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, kvh, stride_c_blk, stride_c_tok, stride_c_head,
        n_full, n_all, key_limit, seq_len, scale_log2, d, dmask,
        True, EVEN_D, BLOCK_SIZE, TILE_N, DOT_PRECISION, D, BLOCK_D, KV_FP8, FP8_MANT, KVH, FP8_F16, FP8_ASM,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask)


@dataclass
class PrefillPartials:
    """Partial attentions a library kernel computed for some sequences of a step (long_prefill.py).

    Per sequence (device int32 [num_seqs]): kv_lo (keys [0, kv_lo) are in partial 1 when flags & 1; a
    multiple of the kernel's tile) and flags (2: partial 2 holds the chunk's own keys, causal). Partials:
    o [rows, H, D] and lse [H, rows] (natural log, float32), where row r holds the step's query row
    r + row0: a library call's own outputs when one sequence has partials (no copy), else step-wide buffers.
    """

    kv_lo: torch.Tensor
    flags: torch.Tensor
    o1: torch.Tensor
    lse1: torch.Tensor
    o2: torch.Tensor
    lse2: torch.Tensor
    row0: int = 0


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, num_seqs: int,
                      out: torch.Tensor | None = None, block_m: int = 128, tile_n: int = 64, num_warps: int = 8,
                      num_stages: int = 3, partials: PrefillPartials | None = None,
                      kv_format: fp8_kv.Fp8Format | None = None) -> torch.Tensor:
    """q: [num_tokens, H, D] (flattened queries of `num_seqs` sequences, split by query_start_loc).
    Returns [num_tokens, H, D] in q's dtype. With `partials`, the sequences they cover start from them.
    kv_format: the caches are fp8 layer views (uint8, fp8_kv's layout)."""
    num_tokens, num_heads, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    if out is None:
        out = torch.empty_like(q)
    # Upper bound on the q blocks of all sequences (see the kernel's search): exact grid without a sync.
    num_q_blocks = num_tokens // block_q + num_seqs
    if partials is None:
        p_args = (seq_lens, seq_lens, q, q, q, q, 0, 0, 0, 0)  # never read
    else:
        p = partials
        assert p.o1.stride() == p.o2.stride() and p.lse1.stride() == p.lse2.stride() and p.lse1.stride(1) == 1
        p_args = (p.kv_lo, p.flags, p.o1, p.lse1, p.o2, p.lse2, p.o1.stride(0), p.o1.stride(1), p.lse1.stride(0),
                  p.row0)
    _prefill_kernel[(num_q_blocks, kvh)](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0),
        seq_lens, query_start_loc, num_seqs, num_q_blocks,
        out, out.stride(0), out.stride(1),
        *p_args,
        scale * LOG2E,
        G=group, BLOCK_Q=block_q, BLOCK_M=block_m, D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_SIZE=block_size, TILE_N=tile_n, DOT_PRECISION=_dot_precision(q.dtype),
        EVEN_D=d == triton.next_power_of_2(d), HAS_PARTIALS=partials is not None, **_read_args(kv_format, k_cache, d, q),
        KVH=kvh, num_warps=num_warps, num_stages=num_stages,
    )
    return out
