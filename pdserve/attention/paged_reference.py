"""Random paged-attention cases and a float SDPA reference to check attention kernels against: the CUDA fp8
decode kernel's self-check when it is first used (pdserve/attention/cuda_fp8_decode.py), the GPU correctness
checks (pdserve/testing/gpu_correctness.py), the kernel tests and benchmarks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.attention import fp8_kv
from pdserve.attention.base import AttentionMetadata


@dataclass
class PagedCase:
    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kvh, d]
    layer: int
    meta: AttentionMetadata
    q: torch.Tensor  # [num_tokens, heads, d]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 1]


def make_paged_case(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int = 16, num_layers: int = 2, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cuda", seed: int = 0, spare_blocks: int = 8,
                    table_width: int | None = None) -> PagedCase:
    """Random pool, random (shuffled) block tables, queries the last q_len of each seq_len positions."""
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # GB-sized pools: draw them on the device
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randn((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), generator=dev_gen,
                       device=device, dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = table_width or max(blocks_per_seq)
    # int64 metadata, as the engine's GPU path builds it (one compiled kernel variant serves both)
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int64)
    used = 0
    slots: list[int] = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        nb = blocks_per_seq[i]
        tables[i, :nb] = torch.tensor(perm[used : used + nb])
        used += nb
        slots += [int(tables[i, j // block_size]) * block_size + j % block_size for j in range(s - q, s)]
    meta = AttentionMetadata.from_host(query_lens, seq_lens, tables, slots, block_size, device)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=dev_gen, device=device).to(dtype)
    return PagedCase(pool, num_layers - 1, meta, q)


class SdpaReference:
    """Paged attention by gathering each sequence's blocks and calling SDPA, on any device.
    (pdserve.attention.torch_ref.TorchAttention is the same method, written for the CPU.)"""

    name = "sdpa-reference"

    def __init__(self, compute_dtype: torch.dtype | None = None):
        self.compute_dtype = compute_dtype  # e.g. float32: the reference for bf16 kernels

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata, kv_scale=None) -> None:
        # the backends' signature (decoder.Attention passes an fp8 pool's kv_scale); a float cache ignores it
        slots = meta.slot_mapping
        keep = slots >= 0
        slots = slots[keep]
        blk = torch.div(slots, meta.block_size, rounding_mode="floor")
        k_cache[blk, slots - blk * meta.block_size] = k[keep]
        v_cache[blk, slots - blk * meta.block_size] = v[keep]

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        dt = self.compute_dtype or q.dtype
        bs = meta.block_size
        start = 0
        seq_lens = meta.seq_lens.tolist()  # host sync: fine for a reference
        q_lens = [b - a for a, b in zip(meta.query_start_loc.tolist()[:-1], meta.query_start_loc.tolist()[1:],
                                        strict=True)]
        for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
            if seq_len == 0:
                out[start : start + q_len] = 0
                start += q_len
                continue
            nb = (seq_len + bs - 1) // bs
            table = meta.block_tables[i, :nb].long()
            k = k_cache[table].flatten(0, 1)[:seq_len].to(dt)
            v = v_cache[table].flatten(0, 1)[:seq_len].to(dt)
            qi = q[start : start + q_len].to(dt).transpose(0, 1)
            ctx = seq_len - q_len
            mask = torch.arange(seq_len, device=q.device)[None, :] <= (ctx + torch.arange(q_len, device=q.device))[:, None]
            o = F.scaled_dot_product_attention(qi, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
            start += q_len
        return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.double()
    want = want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def fp8_case(c: PagedCase, kv_format_name: str) -> tuple[PagedCase, PagedCase]:
    """The case with its pool quantized to fp8 blocks (pdserve.attention.fp8_kv), and the same case over the
    dequantized pool in the case's dtype: what the fp8 kernels must compute is attention over the latter."""
    fmt = fp8_kv.fp8_format(kv_format_name)
    raw = fp8_kv.quantize_pool(c.pool, fmt)
    return dataclasses.replace(c, pool=raw), dataclasses.replace(c, pool=fp8_kv.dequantize_pool(raw, fmt, c.q.dtype))
