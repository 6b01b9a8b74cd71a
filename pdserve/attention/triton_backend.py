"""Paged attention on our own Triton kernels: the GPU backend (`select_attention_backend` picks it on CUDA).

Chosen over a carried FlashInfer wheel because it installs from PyPI with any CUDA torch (triton ships
with it), needs no 12-63 s JIT per kernel on a fresh machine, and reads the block-contiguous pool's
strided per-layer views directly. benchmarks/gpu_suite.py measures it against the H200's ceilings and the
FlashInfer numbers in h200-facts.md.

With `long_prefill` set (`--attention-backend triton-cudnn`, what `auto` picks where cuDNN's attention
runs), long prefill chunks take most of their attention from cuDNN over gathered K/V and the Triton kernel
finishes them (pdserve/attention/long_prefill.py); everything else is unchanged.

With `kv_format` (an fp8 KV cache, pdserve.attention.fp8_kv) the same kernels quantize on write and
dequantize on the fly (no host syncs: decode steps stay in CUDA graphs); long chunks dequantize their
gathered K/V for cuDNN.
"""

from __future__ import annotations

import torch

from pdserve.attention import cuda_fp8_decode as cfd
from pdserve.attention import fp8_kv
from pdserve.attention import long_prefill as lp
from pdserve.attention import triton_kernels as tk
from pdserve.attention.base import AttentionMetadata, KvScale

# Prefill launch parameters (block_m, tile_n, num_warps, num_stages), from the sweep in
# benchmarks/gpu_kernel_lab.py on an H200 (2026-12-01): short queries (B=8, q 512 of kv 2048) 268 TFLOP/s
# with 128/128/8/4; long ones (q 8192, kv 8k-128k) 342-398 TFLOP/s with 128/64/4/4.
PREFILL_CONFIG_SHORT = (128, 128, 8, 4)
PREFILL_CONFIG_LONG = (128, 64, 4, 4)
PREFILL_LONG_FROM_Q = 1024  # a step whose longest query run is at least this uses the long config
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

# The same for an fp8 pool, with a sixth entry: a register cap per thread (None: none). At batch 64 / kv 4096
# on the H200 (2026-12-02, V stored dim-major, e4m3 by the conversion instruction; BENCHMARKS.md, FP8 KV cache,
# run 6): tile 128 / 4 warps / 2 stages capped at 128 registers (no spills) fits 4 programs per SM instead of 3
# at the uncapped 166, so the 512 (sequence, kv head) programs of batch 64 all run in one wave, unsplit: 135 us
# per layer, vs 149 split in two (4 per SM: the merge kernel alone ~8 us), 171 uncapped. Before (V token-major,
# e4m3 by bit moves): 211 us. Smaller batches, kv 4096, same run (results/h200-fp8-kv/vt_small_batches.json):
# batch 1 8.8 us with bf16's settings (128-token tiles 9.2); batch 8 28.8 us at 4 per SM (bf16's settings 42.7,
# bf16 40.3); batch 24 63.8 us at 2 per SM (4 per SM 78.5, bf16's settings 104.0, bf16 127.8).
FP8_DECODE_CONFIGS: list[tuple] = [
    DECODE_CONFIGS[0],
    (12, 128, 4, 2, 4, 128),
    (1 << 30, 128, 4, 2, 2, 128),
]


def decode_config(batch: int, configs: list[tuple] | None = None) -> tuple[int, int, int, int, int | None]:
    """(tile_n, num_warps, num_stages, programs per SM, register cap or None) of `batch`'s bucket."""
    configs = DECODE_CONFIGS if configs is None else configs
    row = next((r for r in configs if batch <= r[0]), configs[-1])
    return (*row[1:5], row[5] if len(row) > 5 else None)


def prefill_config(max_query_len: int) -> tuple[int, int, int, int]:
    return PREFILL_CONFIG_LONG if max_query_len >= PREFILL_LONG_FROM_Q else PREFILL_CONFIG_SHORT


class TritonAttention:
    name = "triton"  # with or without long_prefill: the step runner keys the fused ops and graphs on it
    supports_verify_graphs = True  # meta.verify_rows: the multi-query decode kernel

    def __init__(self, num_sms: int | None = None, long_prefill: lp.LongPrefillConfig | None = None,
                 kv_format: fp8_kv.Fp8Format | None = None):
        self.kv_format = kv_format  # None: the pool holds the model's dtype; else fp8 rows (uint8)
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.num_sms = num_sms
        self.long_prefill = long_prefill
        # decode's split merge in the attention kernel's last program per (sequence, kv head) instead of the
        # merge kernel: off. Measured on the H200 (issue 21, BENCHMARKS.md "Decode, batch 1"): faster at
        # batch 1 with up to ~330 keys (7.6 us per layer vs 4.4 + 2.5 for attention + merge kernel), slower
        # with 128-530 keys (9.4 us per layer), and longer contexts have every split active (the last
        # program's merge reads them 8 at a time, in series). Kept switchable for the suite's A/B.
        self.fused_decode_merge = False
        self.fused_merge_max_batch = 1  # where it was measured (P1); larger split batches keep the merge kernel
        self._merge_counters: torch.Tensor | None = None
        if long_prefill is not None:
            # the kernel starts the keys left after partial 1 at a tile boundary
            assert all(long_prefill.ctx_align % cfg[1] == 0 for cfg in (PREFILL_CONFIG_SHORT, PREFILL_CONFIG_LONG))

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, budget: int, max_model_len: int) -> int:
        """Library plans for full-budget long chunks (long_prefill.warm_up), and for an fp8 pool the CUDA decode
        kernel's build and check (~20 s of nvcc once per machine, cached; here rather than in the first step,
        and before any graph is captured); the Triton kernels JIT on first use."""
        if self.kv_format is not None and cfd.selected() and device.type == "cuda":
            cfd.prepare(device)
        if self.long_prefill is None or self.long_prefill.impl != "cudnn":
            return 0
        return lp.warm_up(num_heads, num_kv_heads, head_dim, dtype, device, budget, max_model_len)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata, kv_scale: KvScale | None = None) -> None:
        tk.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.block_size, self.kv_format, kv_scale)

    def _counters(self, device: torch.device, needed: int) -> torch.Tensor | None:
        """The fused merge's counters (kept at zero by the kernel between launches). Made once, outside any
        graph capture, large enough for every split decode batch (splits > 1 needs batch * kv heads below
        the programs wanted in flight, a few per SM); never replaced, as captured graphs hold its address.
        None: the separate merge kernel runs."""
        c = self._merge_counters
        if c is None and self.fused_decode_merge:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            c = self._merge_counters = tk.new_merge_counters(device, max(4096, 64 * self.num_sms))
        if c is None or not self.fused_decode_merge or c.device != device or c.numel() < needed:
            return None
        return c

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if meta.verify_rows:
            return self._verify(q, k_cache, v_cache, meta, scale)
        if meta.decode_only:
            batch = q.shape[0]
            if self.kv_format is not None and cfd.selected() and cfd.usable(q, k_cache, self.kv_format):
                splits = tk.decode_num_splits(batch, k_cache.shape[2], self.num_sms, cfd.PROGRAMS_PER_SM)
                return cfd.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits,
                                            self.kv_format, stages=cfd.DEFAULT_STAGES)
            tile_n, warps, stages, pps, max_regs = decode_config(batch, FP8_DECODE_CONFIGS if self.kv_format else None)
            splits = tk.decode_num_splits(batch, k_cache.shape[2], self.num_sms, pps)
            return tk.decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits,
                tile_n=tile_n, num_warps=warps, num_stages=stages, kv_format=self.kv_format, max_regs=max_regs,
                merge_counters=(self._counters(q.device, batch * k_cache.shape[2])
                                if splits > 1 and batch <= self.fused_merge_max_batch else None),
            )
        partials = None
        lpc = self.long_prefill
        if lpc is not None:
            plans = lp.plan_chunks(meta, lpc.min_q, lpc.ctx_align, lpc.q_bucket)
            if plans:
                if len(meta.seq_lens_host) == 1 and lp.is_whole_fresh_prompt(plans[0]):
                    return lp.attend_fresh_prompt(q, k_cache, v_cache, meta, scale, lpc.impl, self.kv_format)
                partials = lp.compute_partials(q, k_cache, v_cache, meta, plans, scale, lpc.impl, self.kv_format)
        block_m, tile_n, warps, stages = prefill_config(meta.max_query_len)
        return tk.prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            num_seqs=meta.seq_lens.shape[0], block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages,
            partials=partials, kv_format=self.kv_format,
        )

    def _verify(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """A verify step's K + 1 rows per sequence (meta.verify_rows): the split-KV decode kernel with the rows of
        a sequence in one program, so its K/V are read once as in a plain decode step; tile and split settings
        are plain decode's for the same number of sequences (the programs and the K/V bytes are the same)."""
        rows = meta.verify_rows
        batch = q.shape[0] // rows
        tile_n, warps, stages, pps, max_regs = decode_config(batch, FP8_DECODE_CONFIGS if self.kv_format else None)
        splits = tk.decode_num_splits(batch, k_cache.shape[2], self.num_sms, pps)
        return tk.decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits, tile_n=tile_n, num_warps=warps,
            num_stages=stages, kv_format=self.kv_format, max_regs=max_regs, rows_per_seq=rows,
            query_positions=meta.query_positions)
