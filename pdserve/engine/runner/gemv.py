"""Batch-1 linear layers (GEMV) of a one-token decode step, and the GEMVs that finish the next op in their
epilogue: SiLU-and-mul after gate_up, RoPE + the K/V store after qkv, the greedy argmax after the LM head.

Why not cuBLAS at batch 1: on the H200 its GEMVs for Llama-3.1-8B's matrices read the weights at 2.6-4.2
TB/s, this kernel at 3.0-4.4 (benchmarks/gpu_kernel_lab.py, graph-replayed over rotating weights,
2026-12-01: qkv 17.1 -> 14.3 us, o 12.8 -> 11.0, gate_up 62.0 -> 56.9, down 31.8 -> 29.7, lm_head 250 ->
239): ~0.4 ms of a 4.7 ms decode step. Fusing the RMSNorm or SiLU into its prologue measured slower than
the separate kernels (each program re-reads the activation), so those stay apart.

Why the epilogues (issue 21): at batch 1 the step is ~330 kernels, and every small kernel costs its own
time (1.5-4 us for a few KB) plus a launch gap in the graph. The ops that follow a GEMV element-wise on
pairs of its output rows are folded into it by giving each program the row pairs the op needs, and the ops
that need the whole output run in the program that finishes last (an atomic count per launch):
- gate_up: rows j and I + j (gate and up) -> silu(gate) * up, written as [I];
- qkv: rows j and j + D/2 of one head (the two halves RoPE rotates together) -> rotated q to its buffer,
  rotated k and v straight to their cache slot;
- LM head: each program's best logit and its index go into one packed 64-bit atomic max (ties to the
  lower index, as torch.argmax); the last program to finish writes the token and resets the scratch;
- o_proj and down_proj: the last program adds the output to the residual stream and applies the next
  RMSNorm (`NORM_EPILOGUE`).
Each epilogue rounds where the unfused ops round (the GEMV output to the model dtype first), so the
results are the same bits as gemv followed by ops.silu_and_mul / ops.rope_and_write_kv / argmax.

`EPILOGUE_FUSIONS` switches them (the unfused kernels run when off; PDSERVE_DECODE_FUSIONS=0 at start):
benchmarks/gpu_suite.py measures both ways in one run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.runner import skinny_gemm
from pdserve.engine.runner.decode_fusions import decode_fusions_from_env

EPILOGUE_FUSIONS = decode_fusions_from_env()  # on unless PDSERVE_DECODE_FUSIONS=0
# the residual add + RMSNorm after o_proj and down_proj in the GEMV's last program (within EPILOGUE_FUSIONS)
NORM_EPILOGUE = True

# The argmax scratch's resting value: below every packed (logit, index) key (the smallest non-NaN key is
# -inf's, (-2139095041 << 32) | ...).
ARGMAX_KEY_RESET = -(2**63) + 1


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _config(k: int) -> tuple[int, int, int]:
    """(rows per program, columns per step, warps): the lab's winners, 8 x 512 x 4 warps; for the long
    down-projection rows 16 x 1024 x 8."""
    block_n, block_k, warps = (16, 1024, 8) if k >= 8192 else (8, 512, 4)
    return block_n, min(block_k, triton.next_power_of_2(k)), warps


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, b_ptr, y_ptr, key_ptr, tok_ptr, res_ptr, nw_ptr, h_ptr, eps, N, K, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ARGMAX: tl.constexpr, ADD_NORM: tl.constexpr, BLOCK_NORM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols0 = tl.arange(0, BLOCK_K)
    # one [BLOCK_N, BLOCK_K] float32 partial per program, reduced once at the end: the loop is pure loads
    # and FMAs, many 16-byte weight loads in flight per thread
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    wrow = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + cols0
        if EVEN_K:
            w = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
            x = tl.load(x_ptr + cols)
        else:
            w = tl.load(wrow + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K), other=0.0)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    # rounded to the model dtype even when stored wider (the LM head's float32 logits: HF's `.float()`)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
    if ARGMAX:
        _argmax_epilogue(y, rows, rmask, key_ptr, tok_ptr)
    if ADD_NORM:
        _add_rms_norm_epilogue(y_ptr, res_ptr, nw_ptr, h_ptr, key_ptr, N, eps, BLOCK_NORM)


@triton.jit
def _add_rms_norm_epilogue(y_ptr, res_ptr, nw_ptr, h_ptr, cnt_ptr, N, eps, BLOCK: tl.constexpr):
    """The last program to finish: residual += y (in place), h = rms_norm(residual) * weight, as
    ops.fused_add_rms_norm rounds. The barrier puts this program's y stores before its count (acq_rel);
    the last one reads every program's y past L1 and resets the counter for the next launch."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1)
    if done == tl.num_programs(0) - 1:
        tl.store(cnt_ptr, 0)  # at rest for the next launch (nothing else touches it in this one)
        tl.debug_barrier()
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(y_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        hr = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + cols, hr, mask=mask)
        x = hr.to(tl.float32)
        var = tl.sum(x * x, 0) / N
        yn = (x * tl.rsqrt(var + eps)).to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + cols, (w * yn).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _argmax_epilogue(y, rows, rmask, key_ptr, tok_ptr):
    """key_ptr[0]: the packed running max, key_ptr[1]: programs done (both at rest between launches)."""
    v = tl.where(rmask, y, float("-inf"))
    best = tl.max(v, 0)
    idx = tl.min(tl.where(v == best, rows, 2147483647), 0)  # the first index of the max, as torch.argmax
    best = tl.where(best == 0.0, 0.0, best)  # -0.0 == +0.0
    bits = best.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as signed int order
    key = (ordered.to(tl.int64) << 32) | (4294967295 - idx.to(tl.int64))  # ties: the lower index wins
    tl.atomic_max(key_ptr, key)
    # acq_rel: every program's max is in before its count, so the last one to count sees all of them
    done = tl.atomic_add(key_ptr + 1, 1)
    if done == tl.num_programs(0) - 1:
        top = tl.atomic_xchg(key_ptr, -9223372036854775807)  # == ARGMAX_KEY_RESET
        tl.store(key_ptr + 1, 0)  # at rest for the next launch (every program has counted)
        tl.store(tok_ptr, 4294967295 - (top & 4294967295))


def linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """layer(x), with one input row of a plain nn.Linear on the GEMV kernel above (the batch-1 decode step).
    Other layers (e.g. the CPU engine's packed linears, in tests that run this path on the CPU) run as they
    are."""
    weight = _gemv_weight(x, layer)
    if weight is None:
        few = skinny_gemm.skinny_weight(x, layer)  # 2..32 rows, PDSERVE_SKINNY_GEMM=1 only (an experiment)
        return layer(x) if few is None else skinny_gemm.skinny_matmul(x, few, layer.bias)
    return gemv(x, weight, layer.bias)


def _gemv_weight(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor | None:
    weight = getattr(layer, "weight", None)
    if x.shape[0] != 1 or x.dim() != 2 or not isinstance(weight, torch.Tensor) or weight.stride(-1) != 1:
        return None
    return weight


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N] in x's dtype."""
    n, k = weight.shape
    x = _rows(x)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _config(k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        weight, x, bias if bias is not None else x, y, x, x, x, x, x, 0.0, n, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, ARGMAX=False,
        ADD_NORM=False, BLOCK_NORM=1, num_warps=warps,
    )
    return y


def new_epilogue_scratch(device: torch.device) -> torch.Tensor:
    """What the epilogues keep between launches, at rest: [0:2] lm_head_argmax's (packed running max,
    programs done), [2:3] linear_add_rms_norm's counter."""
    return torch.tensor([ARGMAX_KEY_RESET, 0, 0], dtype=torch.int64, device=device)


def lm_head_argmax(x: torch.Tensor, layer: torch.nn.Module,
                   scratch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(float32 logits [1, V], greedy token [1] int64) of one hidden row, the argmax in the GEMV's
    epilogue; None where it does not apply (the caller runs the LM head and argmax apart)."""
    weight = _gemv_weight(x, layer)
    if weight is None or scratch is None or not EPILOGUE_FUSIONS or getattr(layer, "bias", None) is not None:
        return None
    n, k = weight.shape
    x = _rows(x)
    logits = torch.empty((1, n), dtype=torch.float32, device=x.device)
    token = torch.empty(1, dtype=torch.int64, device=x.device)
    block_n, block_k, warps = _config(k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        weight, x, x, logits, scratch, token, x, x, x, 0.0, n, k, weight.stride(0), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=False, ARGMAX=True, ADD_NORM=False, BLOCK_NORM=1,
        num_warps=warps,
    )
    return logits, token


def linear_add_rms_norm(x: torch.Tensor, layer: torch.nn.Module, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, scratch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ops.fused_add_rms_norm(layer(x), residual, weight, eps) for one row in one launch: the GEMV's last
    program does the residual add and the norm. scratch: one int64 counter at rest (0). None where it
    does not apply."""
    w = _gemv_weight(x, layer)
    if w is None or scratch is None or not (EPILOGUE_FUSIONS and NORM_EPILOGUE) or residual.stride(-1) != 1:
        return None
    n, k = w.shape
    if n > 16384 or residual.shape != (1, n):
        return None
    x = _rows(x)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    h = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _config(k)
    bias = layer.bias
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        w, x, bias if bias is not None else x, y, scratch, x, residual, weight, h, eps, n, k, w.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, ARGMAX=False,
        ADD_NORM=True, BLOCK_NORM=triton.next_power_of_2(n), num_warps=warps,
    )
    return h, residual


# ---------------------------------------------------------------------------------------------------
# GEMVs over row pairs, with an element-wise epilogue on each pair
# ---------------------------------------------------------------------------------------------------
EPI_SILU = 0
EPI_ROPE_KV = 1


@triton.jit
def _gemv_pairs_kernel(
    w_ptr, x_ptr, b_ptr, K, stride_w, n_pairs,
    out_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, stride_c_blk, stride_c_tok, stride_c_head, slot_ptr,
    HALF: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # pair p = rows (row1, row1 + HALF), row1 = (p // HALF) * 2 * HALF + p % HALF: gate_up has one "head"
    # of 2 * I rows (HALF = I), qkv one per attention head (HALF = head_dim / 2)
    p = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    pmask = p < n_pairs
    row1 = (p // HALF) * (2 * HALF) + p % HALF
    row2 = row1 + HALF
    cols0 = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros([PAIRS, BLOCK_K], tl.float32)
    acc2 = tl.zeros([PAIRS, BLOCK_K], tl.float32)
    w1 = w_ptr + row1.to(tl.int64)[:, None] * stride_w
    w2 = w_ptr + row2.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + cols0
        if EVEN_K:
            m = pmask[:, None]
            x = tl.load(x_ptr + cols)
        else:
            m = pmask[:, None] & (cols[None, :] < K)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        a = tl.load(w1 + cols[None, :], mask=m, other=0.0)
        b = tl.load(w2 + cols[None, :], mask=m, other=0.0)
        xf = x.to(tl.float32)[None, :]
        acc1 += a.to(tl.float32) * xf
        acc2 += b.to(tl.float32) * xf
    y1 = tl.sum(acc1, 1)
    y2 = tl.sum(acc2, 1)
    if HAS_BIAS:
        y1 += tl.load(b_ptr + row1, mask=pmask, other=0.0).to(tl.float32)
        y2 += tl.load(b_ptr + row2, mask=pmask, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    # the GEMV's output as the unfused path holds it: rounded to the model dtype
    y1 = y1.to(dt).to(tl.float32)
    y2 = y2.to(dt).to(tl.float32)
    if EPILOGUE == 0:  # silu(gate) * up, silu rounded before the product (ops.silu_and_mul)
        act = (y1 / (1.0 + tl.exp(-y1))).to(dt).to(tl.float32)
        tl.store(out_ptr + p, (act * y2).to(dt), mask=pmask)
    else:  # RoPE on q and k (ops._rope_heads' rounding), then q out, k and v to the token's slot
        head = (tl.program_id(0) * PAIRS) // HALF  # PAIRS divides HALF: one head per program
        j = p % HALF
        if head < H + KVH:
            cos = tl.load(cos_ptr + j).to(tl.float32)  # cos/sin rows are cat(freqs, freqs)
            sin = tl.load(sin_ptr + j).to(tl.float32)
            o1 = ((y1 * cos).to(dt).to(tl.float32) + (-y2 * sin).to(dt).to(tl.float32)).to(dt)
            o2 = ((y2 * cos).to(dt).to(tl.float32) + (y1 * sin).to(dt).to(tl.float32)).to(dt)
        else:
            o1 = y1.to(dt)
            o2 = y2.to(dt)
        if head < H:
            dst = out_ptr + head * (2 * HALF) + j
            tl.store(dst, o1)
            tl.store(dst + HALF, o2)
        else:
            slot = tl.load(slot_ptr).to(tl.int64)
            if slot >= 0:  # a CUDA graph's padding row carries slot -1
                kv_head = head - H
                cache = k_cache_ptr
                if head >= H + KVH:
                    kv_head = head - H - KVH
                    cache = v_cache_ptr
                row = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
                tl.store(cache + row + j, o1)
                tl.store(cache + row + j + HALF, o2)


def _pairs_per_program(half: int) -> int:
    for pairs in (4, 2, 1):  # 8 rows per program, as the plain GEMV (or fewer when a head is tiny)
        if half % pairs == 0:
            return pairs
    return 1


def gate_up_silu(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor | None:
    """silu(gate) * up of one row, [1, I], from the fused gate_up layer ([2I, K]: gate rows, then up rows);
    None where the fusion does not apply."""
    weight = _gemv_weight(x, layer)
    if weight is None or not EPILOGUE_FUSIONS:
        return None
    n, k = weight.shape
    half = n // 2
    x = _rows(x)
    out = torch.empty((1, half), dtype=x.dtype, device=x.device)
    _, block_k, warps = _config(k)
    pairs = 4
    bias = layer.bias
    _gemv_pairs_kernel[(triton.cdiv(half, pairs),)](
        weight, x, bias if bias is not None else x, k, weight.stride(0), half,
        out, x, x, x, x, 0, 0, 0, x,
        HALF=half, PAIRS=pairs, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None,
        EPILOGUE=EPI_SILU, H=1, KVH=1, BLOCK_SIZE=1, num_warps=warps,
    )
    return out


def qkv_rope_and_write_kv(x: torch.Tensor, layer: torch.nn.Module, num_heads: int, num_kv_heads: int,
                          head_dim: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """One token's qkv projection with RoPE and the K/V store in its epilogue: returns the rotated q
    [1, H, D]; k and v go to the token's slot in the model-dtype pool. None where the fusion does not apply
    (more rows, an fp8 pool: its row scale needs the whole row)."""
    weight = _gemv_weight(x, layer)
    if (weight is None or not EPILOGUE_FUSIONS or k_cache.dtype != x.dtype or head_dim % 2
            or weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim):
        return None
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    n, k = weight.shape
    half = head_dim // 2
    x = _rows(x)
    q = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    _, block_k, warps = _config(k)
    pairs = _pairs_per_program(half)
    bias = layer.bias
    _gemv_pairs_kernel[(n // 2 // pairs,)](
        weight, x, bias if bias is not None else x, k, weight.stride(0), n // 2,
        q, cos, sin, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), slot_mapping,
        HALF=half, PAIRS=pairs, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None,
        EPILOGUE=EPI_ROPE_KV, H=num_heads, KVH=num_kv_heads, BLOCK_SIZE=block_size, num_warps=warps,
    )
    return q
