"""Reference paged attention on torch SDPA: gathers each sequence's blocks, then attends.

This is the CPU path and the oracle GPU kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionMetadata


class TorchAttention:
    name = "torch-sdpa"
    # meta.verify_rows (the step runner's verify graphs, simulated on the CPU in tests; never captured)
    supports_verify_graphs = True

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata, kv_scale=None) -> None:
        # a float cache stores the values as they are: kv_scale (an fp8 pool's) does not apply
        slots = meta.slot_mapping
        # a decode or verify graph's padding rows: slot -1, no store
        if (meta.decode_only or meta.verify_rows) and bool((slots < 0).any()):
            keep = slots >= 0
            slots, k, v = slots[keep], k[keep], v[keep]
        block_idx = torch.div(slots, meta.block_size, rounding_mode="floor")
        offset = slots - block_idx * meta.block_size
        k_cache[block_idx, offset] = k
        v_cache[block_idx, offset] = v

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.decode_only or meta.verify_rows:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for i, q_len in enumerate(meta.query_lens_host):
            out[start : start + q_len] = self.attend_one(q[start : start + q_len], k_cache, v_cache, meta, i, scale)
            start += q_len
        return out

    def attend_one(self, qi, k_cache, v_cache, meta: AttentionMetadata, i: int, scale: float) -> torch.Tensor:
        """Sequence i's query rows qi ([q_len, heads, d]) over its gathered blocks."""
        q_len, seq_len = qi.shape[0], meta.seq_lens_host[i]
        n_blocks = (seq_len + meta.block_size - 1) // meta.block_size
        table = meta.block_tables[i, :n_blocks]
        k = k_cache[table].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, d]
        v = v_cache[table].flatten(0, 1)[:seq_len]
        if q_len == seq_len:
            mask = None
            causal = True
        else:
            # Queries are the last q_len positions: query j sees keys [0, seq_len - q_len + j].
            ctx = seq_len - q_len
            dev = qi.device
            mask = torch.arange(seq_len, device=dev)[None, :] <= (ctx + torch.arange(q_len, device=dev))[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=True,
        )
        return o.transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # One padded batched SDPA call for all sequences: much cheaper than a Python loop per sequence.
        # A verify step (meta.verify_rows R): R rows per sequence, row t sees keys [0, query_positions[t]].
        bs = meta.block_size
        max_blocks = (meta.max_seq_len + bs - 1) // bs
        tables = meta.block_tables[:, :max_blocks]
        num_seqs = tables.shape[0]
        rows = meta.verify_rows or 1
        k = k_cache[tables].flatten(1, 2)  # [B, max_blocks*bs, kv_heads, d]
        v = v_cache[tables].flatten(1, 2)
        positions = torch.arange(k.shape[1], device=q.device)
        mask = positions[None, None, :] < meta.seq_lens.to(positions.dtype)[:, None, None]  # [B, 1, T]
        if meta.verify_rows:
            limit = meta.query_positions.view(num_seqs, rows, 1)
            mask = mask & (positions[None, None, :] <= limit)  # [B, R, T]
        o = F.scaled_dot_product_attention(
            q.view(num_seqs, rows, q.shape[1], q.shape[2]).transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, :, :],
            scale=scale,
            enable_gqa=True,
        )
        # a padding sequence (seq_len 0) has no key: SDPA gives NaN rows there, the kernels 0
        return torch.nan_to_num(o.transpose(1, 2).reshape(q.shape), nan=0.0) if meta.verify_rows else \
            o.transpose(1, 2).reshape(q.shape)
