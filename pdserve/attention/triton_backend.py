"""Paged attention on our own Triton kernels: the GPU backend (`select_attention_backend` picks it on CUDA).

Chosen over a carried FlashInfer wheel because it installs from PyPI with any CUDA torch (triton ships
with it), needs no 12-63 s JIT per kernel on a fresh machine, and reads the block-contiguous pool's
strided per-layer views directly. benchmarks/gpu_suite.py measures it against the H200's ceilings and the
FlashInfer numbers in h200-facts.md.
"""

from __future__ import annotations

import torch

from pdserve.attention import triton_kernels as tk
from pdserve.attention.base import AttentionMetadata

# Launch parameters, chosen by the sweep in benchmarks/gpu_suite.py on an H200 (see its report).
# prefill: 303 TFLOP/s at B=8 q 512 of kv 2048, 361 TFLOP/s for one fresh 8192-token prompt (2026-11-29)
PREFILL_BLOCK_M = 128
PREFILL_TILE_N = 128
PREFILL_WARPS = 8
PREFILL_STAGES = 3
# decode, by batch size: (largest batch, tile_n, num_warps, num_stages, programs per SM for the splits).
# Winners of the graph-timed sweep over 8 layers on the H200, 2026-11-29 (benchmarks/gpu_suite.py):
# batch 1 kv 2048: 9.0 us/layer; batch 8 kv 2048: 24.4 us (2.75 TB/s of KV); batch 64 kv 2048: 127.6 us
# (4.21 TB/s); batch 256 kv 1024: 263.9 us (4.07 TB/s).
DECODE_CONFIGS: list[tuple[int, int, int, int, int]] = [
    (4, 64, 4, 2, 4),
    (24, 64, 4, 3, 4),
    (128, 64, 4, 2, 2),
    (1 << 30, 128, 8, 3, 1),
]


def decode_config(batch: int) -> tuple[int, int, int, int]:
    for max_batch, tile_n, warps, stages, pps in DECODE_CONFIGS:
        if batch <= max_batch:
            return tile_n, warps, stages, pps
    return DECODE_CONFIGS[-1][1:]


class TritonAttention:
    name = "triton"

    def __init__(self, num_sms: int | None = None):
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.num_sms = num_sms

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        tk.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.block_size)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if meta.decode_only:
            batch = q.shape[0]
            tile_n, warps, stages, pps = decode_config(batch)
            splits = tk.decode_num_splits(batch, k_cache.shape[2], self.num_sms, pps)
            return tk.decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits,
                tile_n=tile_n, num_warps=warps, num_stages=stages,
            )
        return tk.prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            num_seqs=meta.seq_lens.shape[0], block_m=PREFILL_BLOCK_M, tile_n=PREFILL_TILE_N,
            num_warps=PREFILL_WARPS, num_stages=PREFILL_STAGES,
        )
