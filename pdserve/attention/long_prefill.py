"""Long prefill chunks: the bulk of their attention on cuDNN's fused kernel over K/V gathered out of the
paged pool, the rest on our Triton kernel, which starts from cuDNN's partial results.

Why: a chunk of q query tokens over kv keys costs ~q * kv attention FLOPs, while gathering that sequence's
K/V blocks into one contiguous buffer costs ~kv bytes: at q >= 2048 the gather is ~1 % of the attention
time. On contiguous K/V, cuDNN's attention (shipped with CUDA torch) runs at ~600 TFLOP/s on an H200 for
these shapes; our Triton kernel, reading the pool's 16-token blocks through pointer gathers, at ~390
(benchmarks/gpu_kernel_lab.py, 2026-12-01). FlashAttention-2 through torch reached ~340.

How a chunk splits (its queries are the last q of seq_len positions, ctx = seq_len - q of context):
- partial 1, cuDNN, no mask: the queries over keys [0, C), C = ctx rounded down to CTX_ALIGN;
- partial 2, cuDNN, causal: the queries over the chunk's own keys [ctx, seq_len) (a square causal mask,
  which is the only causal alignment torch's cuDNN entry point offers);
- the Triton kernel (`triton_kernels.prefill_attention` with `PrefillPartials`) merges the partials
  through their log-sum-exps, attends the keys left ([C, ctx), and the own keys when partial 2 was not
  taken) and writes the output. Every other sequence of the step runs in that same launch, unchanged.

Plan shapes: torch caches one cuDNN plan per shape, and building one costs ~60-70 ms (measured). So cuDNN
only ever sees q padded to a multiple of Q_BUCKET (padded query rows are dropped; padded own keys sit after
every real query, so the causal mask hides them from real rows) and context lengths that are multiples of
CTX_ALIGN: a bounded set of shapes, built at warm-up for the full-budget chunk (`warm_up`).

"math" runs the same split on plain torch ops (float32): how the CPU tests check planning, padding, partials
and the kernel's merge under Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention import fp8_kv
from pdserve.attention.base import AttentionMetadata

LONG_MIN_Q = 2048  # shorter chunks stay on the Triton kernel alone
CTX_ALIGN = 8192  # partial 1 covers context keys [0, ctx rounded down to this)
Q_BUCKET = 1024  # cuDNN sees q padded to a multiple of this
# partial 2 (causal, cost ~ q_pad^2) only where padding costs less than cuDNN gains over Triton (~1.5x)
CAUSAL_MAX_PAD_COST = 1.5


@dataclass(frozen=True)
class LongPrefillConfig:
    impl: str = "cudnn"  # "cudnn" on CUDA; "math" (float32 torch ops) in CPU tests
    min_q: int = LONG_MIN_Q
    ctx_align: int = CTX_ALIGN
    q_bucket: int = Q_BUCKET


@dataclass(frozen=True)
class ChunkPlan:
    seq: int  # index in the step's batch
    q_start: int
    q_len: int
    seq_len: int
    bulk: int  # partial 1 covers keys [0, bulk); 0 = no partial 1
    q_pad: int
    own: bool  # partial 2 covers the chunk's own keys, causal

    @property
    def ctx(self) -> int:
        return self.seq_len - self.q_len


def plan_chunks(meta: AttentionMetadata, min_q: int = LONG_MIN_Q, ctx_align: int = CTX_ALIGN,
                q_bucket: int = Q_BUCKET) -> list[ChunkPlan]:
    """Which sequences of a prefill step get library partials, from the host-side lengths (no sync)."""
    plans: list[ChunkPlan] = []
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        if q_len >= min_q:
            ctx = seq_len - q_len
            bulk = ctx // ctx_align * ctx_align
            q_pad = -(-q_len // q_bucket) * q_bucket
            own = (q_pad / q_len) ** 2 <= CAUSAL_MAX_PAD_COST
            if bulk or own:
                plans.append(ChunkPlan(i, start, q_len, seq_len, bulk, q_pad, own))
        start += q_len
    return plans


def gather_kv(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache: a per-layer view [num_blocks, block_size, kv_heads, d]; table_row: the sequence's block ids.
    Returns its first seq_len rows, contiguous: [seq_len, kv_heads, d]."""
    block_size = cache.shape[1]
    nb = (seq_len + block_size - 1) // block_size
    rows = cache.flatten(1) if cache[0].is_contiguous() else cache  # one contiguous row per block: fast path
    return rows.index_select(0, table_row[:nb].long()).view(nb * block_size, *cache.shape[2:])[:seq_len]


def gather_float_kv(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int, dtype: torch.dtype,
                    kv_format: fp8_kv.Fp8Format | None = None, *, is_v: bool) -> torch.Tensor:
    """gather_kv, dequantized into `dtype` when the cache holds fp8 blocks (the library kernels read floats;
    the buffer is ~seq_len x kv_heads x head_dim, small next to the chunk's attention work). is_v: `cache` holds
    V (whose fp8 regions are laid out dim-major)."""
    if kv_format is None:
        return gather_kv(cache, table_row, seq_len)
    block_size, kv_heads, d = fp8_kv.region_geometry(cache)
    nb = (seq_len + block_size - 1) // block_size
    blocks = fp8_kv.dequantize_blocks(cache.index_select(0, table_row[:nb].long()), kv_format, dtype, is_v=is_v)
    return blocks.view(nb * block_size, kv_heads, d)[:seq_len]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, H, D] x [S, KVH, D] -> (out [L, H, D] in q's dtype, lse [H, L] float32, natural log); causal is
    top-left aligned (it is used with L == S). float32: the reference path."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, L, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(group, 0)
    s = (qf @ kf.transpose(1, 2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vf
    return o.transpose(0, 1).to(q.dtype), lse


def _attend_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """cuDNN's fused attention (GQA native): [L, H, D] x [S, KVH, D] -> ([L, H, D] view, lse [H, L]).
    The output comes back in q's layout, so the [L, H, D] view is contiguous."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), None, want_lse, 0.0, causal, False, scale=scale)
    return res[0][0].transpose(0, 1), (res[1].reshape(q.shape[1], q.shape[0]) if want_lse else None)


def compute_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     plans: list[ChunkPlan], scale: float, impl: str = "cudnn",
                     kv_format: fp8_kv.Fp8Format | None = None):
    """Runs the library half of every planned chunk. Returns triton_kernels.PrefillPartials.
    kv_format: the caches hold fp8 rows, dequantized per chunk for the library."""
    from pdserve.attention.triton_kernels import PrefillPartials  # triton: GPU, or the interpreter in tests

    attend = _attend_cudnn if impl == "cudnn" else _attend_math
    kv_lo = [0] * len(meta.seq_lens_host)
    flags = [0] * len(meta.seq_lens_host)
    parts: list[tuple[ChunkPlan, tuple | None, tuple | None]] = []
    for p in plans:
        need = p.seq_len if p.own else p.bulk
        k = gather_float_kv(k_cache, meta.block_tables[p.seq], need, q.dtype, kv_format, is_v=False)
        v = gather_float_kv(v_cache, meta.block_tables[p.seq], need, q.dtype, kv_format, is_v=True)
        qp = _pad_rows(q[p.q_start : p.q_start + p.q_len], p.q_pad)
        bulk = own = None
        if p.bulk:
            bulk = attend(qp, k[: p.bulk], v[: p.bulk], False, scale)
            kv_lo[p.seq] = p.bulk
            flags[p.seq] |= 1
        if p.own:
            own = attend(qp, _pad_rows(k[p.ctx :], p.q_pad), _pad_rows(v[p.ctx :], p.q_pad), True, scale)
            flags[p.seq] |= 2
        parts.append((p, bulk, own))
    dev = q.device
    kv_lo_t = torch.tensor(kv_lo, dtype=torch.int32, device=dev)
    flags_t = torch.tensor(flags, dtype=torch.int32, device=dev)
    if len(parts) == 1:
        # one chunk (the usual long prompt): the kernel reads the library's outputs where they are
        p, bulk, own = parts[0]
        o1, lse1 = bulk or own
        o2, lse2 = own or bulk
        if o1.stride() == o2.stride() and lse1.stride() == lse2.stride() and lse1.stride(1) == 1:
            return PrefillPartials(kv_lo_t, flags_t, o1, lse1, o2, lse2, row0=p.q_start)
    num_tokens, num_heads, _ = q.shape
    o1 = torch.empty_like(q)
    lse1 = torch.empty((num_heads, num_tokens), dtype=torch.float32, device=dev)
    o2 = torch.empty_like(q)
    lse2 = torch.empty_like(lse1)
    for p, bulk, own in parts:
        rows = slice(p.q_start, p.q_start + p.q_len)
        for part, o_buf, lse_buf in ((bulk, o1, lse1), (own, o2, lse2)):
            if part is not None:
                o_buf[rows] = part[0][: p.q_len]
                lse_buf[:, rows] = part[1][:, : p.q_len]
    return PrefillPartials(kv_lo_t, flags_t, o1, lse1, o2, lse2)


def is_whole_fresh_prompt(p: ChunkPlan) -> bool:
    """A fresh prompt in one chunk whose length is a bucket multiple: partial 2 is the whole answer."""
    return p.own and p.ctx == 0 and p.q_pad == p.q_len


def attend_fresh_prompt(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, impl: str = "cudnn", kv_format: fp8_kv.Fp8Format | None = None) -> torch.Tensor:
    """A step that is one fresh prompt (is_whole_fresh_prompt): one causal library call, no Triton pass."""
    seq_len = meta.seq_lens_host[0]
    k = gather_float_kv(k_cache, meta.block_tables[0], seq_len, q.dtype, kv_format, is_v=False)
    v = gather_float_kv(v_cache, meta.block_tables[0], seq_len, q.dtype, kv_format, is_v=True)
    if impl == "cudnn":
        o, _ = _attend_cudnn(q, k, v, True, scale, want_lse=False)  # inference mode: no statistics
    else:
        o, _ = _attend_math(q, k, v, True, scale)
    return o.contiguous()


def cudnn_usable(device: torch.device) -> bool:
    """cuDNN's fused attention: CUDA torch with cuDNN 9 on an sm80+ GPU. Probed once with a tiny call."""
    if device.type != "cuda" or not torch.backends.cudnn.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] < 8:
        return False
    try:
        x = torch.randn((64, 2, 64), device=device, dtype=torch.bfloat16)
        _attend_cudnn(x, x[:, :1], x[:, :1], True, 0.125)
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - any failure means: not here
        return False


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
            budget: int, max_model_len: int) -> int:
    """Builds cuDNN's plans for full-budget chunks (q = the step budget, every aligned context length), so
    that a long prompt's first chunks do not pay ~65 ms each. Returns how many shapes it ran."""
    q_pad = budget // Q_BUCKET * Q_BUCKET
    if q_pad < LONG_MIN_Q:
        return 0
    q = torch.randn((q_pad, num_heads, head_dim), device=device, dtype=dtype)
    longest = max(0, max_model_len - q_pad) // CTX_ALIGN * CTX_ALIGN
    kv = torch.randn((max(longest, q_pad), num_kv_heads, head_dim), device=device, dtype=dtype)
    scale = head_dim**-0.5
    _attend_cudnn(q, kv[:q_pad], kv[:q_pad], True, scale)
    shapes = 1
    for bulk in range(CTX_ALIGN, longest + 1, CTX_ALIGN):
        _attend_cudnn(q, kv[:bulk], kv[:bulk], False, scale)
        shapes += 1
    torch.cuda.synchronize(device)
    return shapes


def causal_chunk_flops(num_heads: int, head_dim: int, q_len: int, seq_len: int) -> float:
    """Attention FLOPs of one causal chunk (QK^T and PV, 2 per multiply-add)."""
    keys = q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
    return 4.0 * num_heads * head_dim * keys

