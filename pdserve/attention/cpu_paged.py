"""The CPU attention backend: paged attention without gathering KV blocks.

Per step each sequence takes one of three paths:

- short query runs (decodes, short chunks): the C kernel `pd_paged_attention` reads the K/V blocks where
  they lie in the pool; one call per layer covers all of them (the reference backend gathered every
  sequence's blocks into a padded copy per layer, then ran a masked SDPA over the padding);
- fresh prompts (no cached context): attention over this step's own k/v rows, which `write_kv` has just
  stored, so the pool is not read back: the C kernel `pd_prefill_attention` (register-tiled q k^T and p v
  over a transposed copy of each prompt's keys, the causal half skipped; one call per layer covers every
  fresh prompt; 2.1x SDPA at 512 tokens, 1.35x at 2048) for head sizes 64 and 128, else SDPA with
  consecutive prompts of equal length in one batched call;
- long chunks after a cached context (chunked prefill, prefix-cache hits): gather + SDPA as in
  `torch_ref`.

Without the C kernels (no compiler, PDSERVE_CPU_KERNELS=0) short runs take the reference backend's path.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.torch_ref import TorchAttention
from pdserve.cpu import native

# Query runs up to this length go to the kernel, which re-reads the keys once per query row; longer
# ones are prefill work for SDPA's blocked matmuls.
SHORT_QUERY = 16


class _StepPlan:
    """How this step's sequences split over the three paths (computed once, shared by all layers)."""

    def __init__(self, meta: AttentionMetadata, use_kernel: bool):
        short: list[int] = []
        self.fresh_runs: list[tuple[int, int, int]] = []  # (first query row, number of prompts, length)
        fresh: list[tuple[int, int]] = []  # (first row, end row) of each fresh prompt, for the kernel
        self.cached: list[tuple[int, int, int]] = []  # (sequence index, first row, end row): gather + SDPA
        row = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            if use_kernel and q_len <= SHORT_QUERY:
                short.append(i)
            elif q_len == seq_len:
                fresh.append((row, row + q_len))
                last = self.fresh_runs[-1] if self.fresh_runs else None
                if last is not None and last[2] == q_len and last[0] + last[1] * q_len == row:
                    self.fresh_runs[-1] = (last[0], last[1] + 1, q_len)
                else:
                    self.fresh_runs.append((row, 1, q_len))
            else:
                self.cached.append((i, row, row + q_len))
            row += q_len
        self.short_ids = torch.tensor(short, dtype=torch.int32) if short else None
        self.fresh_rows = torch.tensor(fresh, dtype=torch.int32) if use_kernel and fresh else None


class CpuPagedAttention:
    name = "cpu-paged"

    def __init__(self, lib: ctypes.CDLL | None):
        """lib: `native.load()`'s library; None runs short query runs on the reference path."""
        self.lib = lib
        self.reference = TorchAttention()
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None
        # this layer's new rows, as write_kv received them: fresh prompts attend over these directly
        self._k_new: torch.Tensor | None = None
        self._v_new: torch.Tensor | None = None

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata, kv_scale=None) -> None:
        # a float cache stores the values as they are: kv_scale (an fp8 pool's) does not apply
        self.reference.write_kv(k_cache, v_cache, k, v, meta)
        self.remember_new_kv(k, v)

    def remember_new_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's new rows ([T, KVH, D]), just stored in the cache (by write_kv, or by the fused
        RoPE + store of pdserve.cpu.ops): the next forward's fresh prompts attend over them."""
        self._k_new, self._v_new = k, v

    def _plan_for(self, meta: AttentionMetadata) -> _StepPlan:
        if self._plan_meta is not meta:  # one metadata object per step, shared by every layer
            self._plan = _StepPlan(meta, self.lib is not None)
            self._plan_meta = meta
        return self._plan

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.lib is None or q.dtype != torch.float32:
            return self.reference.forward(q, k_cache, v_cache, meta, scale)
        plan = self._plan_for(meta)
        q = q.contiguous()
        out = torch.empty_like(q)
        if plan.short_ids is not None:
            native.paged_attention(self.lib, q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                   meta.seq_lens, plan.short_ids, scale, out)
        if plan.fresh_rows is not None and q.shape[2] in native.PREFILL_HEAD_DIMS:
            k, v = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()
                    for t in (self._k_new, self._v_new))
            native.prefill_attention(self.lib, q, k, v, plan.fresh_rows, scale, out)
        elif plan.fresh_runs:
            self._fresh_prompts(q, plan.fresh_runs, scale, out)
        if plan.cached:
            self._cached_context(q, k_cache, v_cache, meta, plan.cached, scale, out)
        return out

    def _fresh_prompts(self, q, runs, scale: float, out) -> None:
        heads, d = q.shape[1], q.shape[2]
        kv_heads = self._k_new.shape[1]
        for row, n, length in runs:
            rows = slice(row, row + n * length)
            qi = q[rows].view(n, length, heads, d).transpose(1, 2)
            k = self._k_new[rows].view(n, length, kv_heads, d).transpose(1, 2)
            v = self._v_new[rows].view(n, length, kv_heads, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out[rows] = o.transpose(1, 2).reshape(n * length, heads, d)

    def _cached_context(self, q, k_cache, v_cache, meta: AttentionMetadata, seqs, scale: float, out) -> None:
        for i, start, end in seqs:
            out[start:end] = self.reference.attend_one(q[start:end], k_cache, v_cache, meta, i, scale)
