"""The prefill kernel as it was before issue 21 (v1), kept for side-by-side timing in gpu_kernel_lab.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.triton_kernels import LOG2E, _dot_precision


@triton.jit
def _attend_tiles_v1(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, stride_c_blk, stride_c_tok,
    tile_lo, tile_hi, key_limit, seq_len, scale_log2, d, dmask,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        tok = tile * TILE_N + n
        tmask = tok < seq_len
        if MASKED:
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
        off = blk * stride_c_blk + (tok % BLOCK_SIZE) * stride_c_tok + head_off
        ptrs_k = k_cache_ptr + off[:, None] + d[None, :]
        ptrs_v = v_cache_ptr + off[:, None] + d[None, :]
        # Masks constant along d keep the 16-byte vector loads; full tiles need none at all.
        if MASKED:
            if EVEN_D:
                k = tl.load(ptrs_k, mask=tmask[:, None], other=0.0)
            else:
                k = tl.load(ptrs_k, mask=tmask[:, None] & dmask[None, :], other=0.0)
        else:
            if EVEN_D:
                k = tl.load(ptrs_k)
            else:
                k = tl.load(ptrs_k, mask=dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            # row r sees keys [0, key_limit[r]] (its own absolute position), never past the sequence
            s = tl.where((tok[None, :] <= key_limit[:, None]) & tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a fully masked row must not make NaNs
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            if EVEN_D:
                v = tl.load(ptrs_v, mask=tmask[:, None], other=0.0)
            else:
                v = tl.load(ptrs_v, mask=tmask[:, None] & dmask[None, :], other=0.0)
        else:
            if EVEN_D:
                v = tl.load(ptrs_v)
            else:
                v = tl.load(ptrs_v, mask=dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks", "stride_bt"])
def _prefill_kernel_v1(
    q_ptr, stride_q_t, stride_q_h,
    k_cache_ptr, v_cache_ptr, stride_c_blk, stride_c_tok, stride_c_head,
    block_tables_ptr, stride_bt,
    seq_lens_ptr, qsl_ptr, num_seqs, num_q_blocks,
    out_ptr, stride_o_t, stride_o_h,
    scale_log2,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
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
    q_rows = (q_start + q_local).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=row_mask[:, None] & dmask[None, :], other=0.0)
    key_limit = ctx + q_local  # absolute position of each row's query

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_c_head

    # Keys below the block's first query position are visible to every row: no mask there.
    first_pos = ctx + qb * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    n_full = (first_pos + 1) // TILE_N
    n_all = tl.cdiv(kv_end, TILE_N)
    acc, m_i, l_i = _attend_tiles_v1(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, stride_c_blk, stride_c_tok,
        0, n_full, key_limit, seq_len, scale_log2, d, dmask,
        False, EVEN_D, BLOCK_SIZE, TILE_N, DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles_v1(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, stride_c_blk, stride_c_tok,
        n_full, n_all, key_limit, seq_len, scale_log2, d, dmask,
        True, EVEN_D, BLOCK_SIZE, TILE_N, DOT_PRECISION,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


def prefill_attention_v1(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, num_seqs: int,
                      out: torch.Tensor | None = None, block_m: int = 128, tile_n: int = 64, num_warps: int = 8,
                      num_stages: int = 3) -> torch.Tensor:
    """q: [num_tokens, H, D] (flattened queries of `num_seqs` sequences, split by query_start_loc).
    Returns [num_tokens, H, D] in q's dtype."""
    num_tokens, num_heads, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    if out is None:
        out = torch.empty_like(q)
    # Upper bound on the q blocks of all sequences (see the kernel's search): exact grid without a sync.
    num_q_blocks = num_tokens // block_q + num_seqs
    _prefill_kernel_v1[(num_q_blocks, kvh)](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0),
        seq_lens, query_start_loc, num_seqs, num_q_blocks,
        out, out.stride(0), out.stride(1),
        scale * LOG2E,
        G=group, BLOCK_Q=block_q, BLOCK_M=block_m, D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_SIZE=block_size, TILE_N=tile_n, DOT_PRECISION=_dot_precision(q.dtype),
        EVEN_D=d == triton.next_power_of_2(d), num_warps=num_warps, num_stages=num_stages,
    )
    return out
