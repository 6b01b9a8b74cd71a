"""Attention over an fp8 KV pool for backends that read only float caches: dequantize, then attend.

`Fp8GatherAttention(inner)` quantizes new K/V rows into the uint8 pool (`fp8_kv`), and per step dequantizes
just the blocks the batch's block tables name into a compact float cache, renumbers the tables to it and
runs `inner` (the CPU backend, C kernel included, or the torch reference) on that. Correct everywhere,
not fast: every step reads each touched block once more. The Triton backend reads fp8 in its kernels
instead. The set of touched blocks is found on the host, so this path cannot be captured in a CUDA graph
(`supports_graphs = False`).
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.attention import fp8_kv
from pdserve.attention.base import AttentionBackend, AttentionMetadata, KvScale


class Fp8GatherAttention:
    supports_graphs = False

    def __init__(self, inner: AttentionBackend, fmt: fp8_kv.Fp8Format):
        self.inner = inner
        self.fmt = fmt
        self.name = f"{inner.name}+fp8-gather"
        self._k_new: torch.Tensor | None = None
        self._v_new: torch.Tensor | None = None
        self._step: tuple[AttentionMetadata, torch.Tensor, AttentionMetadata] | None = None

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata, kv_scale: KvScale | None = None) -> None:
        k_scale, v_scale = kv_scale if kv_scale is not None else (None, None)
        k_stored = fp8_kv.write(k_cache, k, meta.slot_mapping, meta.block_size, self.fmt, k_scale, is_v=False)
        v_stored = fp8_kv.write(v_cache, v, meta.slot_mapping, meta.block_size, self.fmt, v_scale, is_v=True)
        # what the pool now holds for these rows, for backends that attend over a step's own rows
        self._k_new = fp8_kv.dequantize(*k_stored, self.fmt, k.dtype)
        self._v_new = fp8_kv.dequantize(*v_stored, self.fmt, v.dtype)

    def _compact(self, meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
        """The blocks this step touches, and the metadata renumbered onto them (shared by every layer)."""
        if self._step is None or self._step[0] is not meta:
            blocks, inverse = torch.unique(meta.block_tables, return_inverse=True)
            written = torch.div(meta.slot_mapping, meta.block_size, rounding_mode="floor")
            new_block = torch.searchsorted(blocks, written)
            slots = new_block * meta.block_size + (meta.slot_mapping - written * meta.block_size)
            compact = dataclasses.replace(meta, block_tables=inverse.to(torch.int32), slot_mapping=slots)
            self._step = (meta, blocks, compact)
        return self._step[1], self._step[2]

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        blocks, compact = self._compact(meta)
        k = fp8_kv.dequantize_blocks(k_cache[blocks], self.fmt, q.dtype, is_v=False)
        v = fp8_kv.dequantize_blocks(v_cache[blocks], self.fmt, q.dtype, is_v=True)
        # the inner backend may keep this step's rows (the CPU backend attends fresh prompts over them)
        self.inner.write_kv(k, v, self._k_new.to(q.dtype), self._v_new.to(q.dtype), compact)
        return self.inner.forward(q, k, v, compact, scale)
