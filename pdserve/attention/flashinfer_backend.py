"""`--attention-backend flashinfer`: prefill steps on FlashInfer's paged prefill kernel where it measured
fastest, everything else on pdserve's own paths. Optional: needs the flashinfer-python package (pyproject
extra `flashinfer`), which JIT-compiles its kernels with nvcc on first use (~1 min per kernel on a fresh
machine, then cached under ~/.cache/flashinfer or $FLASHINFER_WORKSPACE_BASE); the engine's warm-up takes
that cost before serving.

What runs where (H200, same run, BENCHMARKS.md "Prefill attention kernels vs the best library kernel"):
- prefill steps whose chunks are all shorter than long_prefill.LONG_MIN_Q, with enough attention work to
  pay for FlashInfer's per-step plan (flashinfer_support.FLASHINFER_MIN_LAYER_FLOPS): FlashInfer's paged
  prefill (FA3 on Hopper), reading the block-contiguous pool's per-layer views in place (a `(k, v)` tuple of
  strided [num_blocks, block_size, kv_heads, head_dim] views: no gather). B=8, q 512 of kv 2048: 368
  TFLOP/s where our Triton kernel reaches 260. Smaller steps: Triton.
- steps with a long chunk: the `triton-cudnn` path (cuDNN partials over gathered K/V, finished by Triton),
  576-583 TFLOP/s on 8192-token chunks of 32k-128k prompts where FlashInfer reached ~530; without cuDNN,
  FlashInfer.
- steps whose longest query run is at most TRITON_MAX_Q (decode rows, tiny chunks) and decode: our Triton
  kernels, so the fused RoPE + K/V store and the decode CUDA graphs stay exactly the Triton backend's.
  (FlashInfer would pick its FA2 kernel there, a second JIT module. Its paged decode read KV at 2.7 TB/s at
  batch 64 where ours reached 3.9 in the same run; at batch 8 it ran 54-64 us per layer, eager, where ours
  runs ~24 us in the decode CUDA graphs (another run); and it plans each step on the host, from lengths our
  graph replays never bring to the host.)

FlashInfer plans a step on the host (its tile schedule comes from the sequence lengths), once per step
(~1 ms): every layer of that step calls `forward` with the same metadata object and reuses the plan.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.attention import long_prefill as lp
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.flashinfer_support import (
    FLASHINFER_MIN_LAYER_FLOPS,
    TRITON_MAX_Q,
    import_flashinfer,
    paged_plan_inputs,
    takes_flashinfer,
)
from pdserve.attention.triton_backend import TritonAttention

log = logging.getLogger("pdserve.engine")

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)


class FlashInferAttention(TritonAttention):
    name = "flashinfer"  # the step runner gives it the Triton fused ops and decode graphs (its decode path)

    def __init__(self, device: torch.device, num_sms: int | None = None,
                 long_prefill: lp.LongPrefillConfig | None = None):
        """long_prefill: steps with chunks that long take the triton-cudnn path (None: FlashInfer takes them)."""
        super().__init__(num_sms=num_sms, long_prefill=long_prefill)
        self.flashinfer = import_flashinfer()
        self.flashinfer_prefill = True  # False: every step on the Triton paths (benchmarks compare both)
        self.min_layer_flops = FLASHINFER_MIN_LAYER_FLOPS  # 0: every step FlashInfer can take (kernel benchmarks)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self._planned: AttentionMetadata | None = None  # the step the prefill wrapper is planned for
        self._planned_key: tuple | None = None
        self._routed: tuple[AttentionMetadata | None, bool] = (None, False)  # (step, takes FlashInfer)

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, budget: int, max_model_len: int) -> int:
        """Compiles FlashInfer's prefill kernel for this model's head shape (a JIT build on a fresh machine)
        with one small step, so that no request waits for it."""
        t = time.perf_counter()
        bs, q_len = 16, 4 * TRITON_MAX_Q  # FlashInfer's FA3 kernel (it picks FA2 at <= 64 query tokens)
        pages = q_len // bs
        cache = torch.zeros((pages + 1, bs, num_kv_heads, head_dim), dtype=dtype, device=device)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int64, device=device),
            seq_lens=torch.tensor([q_len], dtype=torch.int64, device=device),
            block_tables=torch.arange(1, pages + 1, dtype=torch.int64, device=device)[None],
            slot_mapping=torch.arange(bs, bs + q_len, dtype=torch.int64, device=device),
            block_size=bs, max_query_len=q_len, max_seq_len=q_len, decode_only=False,
            query_lens_host=[q_len], seq_lens_host=[q_len])
        q = torch.zeros((q_len, num_heads, head_dim), dtype=dtype, device=device)
        self._plan(meta, q, cache, head_dim**-0.5)  # directly: too small a step for the routing rule
        self.prefill.run(q, (cache, cache))
        torch.cuda.synchronize(device)
        self._planned = self._planned_key = None
        log.info("FlashInfer prefill kernel ready in %.1f s (JIT-compiled on first use, then cached)",
                 time.perf_counter() - t)
        return 1 + super().warm_up(num_heads, num_kv_heads, head_dim, dtype, device, budget, max_model_len)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if not self._takes_flashinfer(meta, q.shape[1], q.shape[2]):
            return super().forward(q, k_cache, v_cache, meta, scale)
        self._plan(meta, q, k_cache, scale)
        return self.prefill.run(q, (k_cache, v_cache))

    def _takes_flashinfer(self, meta: AttentionMetadata, num_heads: int, head_dim: int) -> bool:
        """flashinfer_support.takes_flashinfer, decided once per step (every layer passes the same meta)."""
        if not self.flashinfer_prefill:
            return False
        step, yes = self._routed
        if step is not meta:
            yes = takes_flashinfer(meta, self.long_prefill, num_heads, head_dim, self.min_layer_flops)
            self._routed = (meta, yes)
        return yes

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        key = (q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, k_cache.dtype, scale)
        if meta is self._planned and key == self._planned_key:
            return  # the step's other layers: same batch, same plan
        qo_indptr, kv_indptr, last_page_len, positions = paged_plan_inputs(meta)
        pos = torch.from_numpy(positions).to(meta.block_tables.device)
        indices = meta.block_tables.reshape(-1).index_select(0, pos).to(torch.int32)
        self.prefill.plan(
            qo_indptr, kv_indptr, indices, last_page_len, num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[2],
            head_dim_qk=q.shape[2], page_size=meta.block_size, causal=True, sm_scale=scale,
            q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        self._planned = meta
        self._planned_key = key
