"""What every paged-attention backend receives per step, and the interface it implements."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """One step's batch: `num_tokens` query tokens from `num_seqs` sequences, flattened.

    Sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]); those are its last q_len_i
    positions out of seq_lens[i] (cached context + new tokens). New K/V rows go to `slot_mapping`
    (block_id * block_size + offset in block).
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_size: int
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every sequence has exactly one query token
    # host copies, so CPU backends never sync on device tensors
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # A speculative verify step in a CUDA graph (engine/runner/verify_graphs.py): every sequence has exactly
    # `verify_rows` query rows (its drafts padded to K, then K + 1), and row t sees keys [0, query_positions[t]]
    # (int64, on the device); a padded row repeats its sequence's last real position, a padding sequence has
    # seq_len 0. Only backends with `supports_verify_graphs` get such a step. 0: not one.
    verify_rows: int = 0
    query_positions: torch.Tensor | None = None

    @classmethod
    def from_host(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: torch.Tensor,
                  slot_mapping: Sequence[int], block_size: int, device: str | torch.device) -> AttentionMetadata:
        """A step's metadata from host lists, int64 on `device` as the engine's GPU path builds it (one compiled
        kernel variant serves both): for reference cases and checks, not the engine's hot path."""
        qsl = [0, *itertools.accumulate(query_lens)]
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_tables=block_tables.to(device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_size=block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            decode_only=all(q == 1 for q in query_lens),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


# A layer's static fp8 KV scales (k_scale, v_scale) from the checkpoint, each a bfloat16 value
# (pdserve.model.kv_scales); None: an fp8 pool's writers compute each row's scale.
KvScale = tuple[float, float]


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        kv_scale: KvScale | None = None,
    ) -> None:
        """Store new k/v rows ([num_tokens, num_kv_heads, head_dim]) into the per-layer cache views
        ([num_blocks, block_size, num_kv_heads, head_dim], strided views of the block-contiguous pool).
        kv_scale: quantize an fp8 pool's rows with these static scales (a float pool has no scales: the
        model runner sets them only for fp8 pools)."""

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of q ([num_tokens, num_heads, head_dim]) over each sequence's cached keys,
        GQA included. Returns [num_tokens, num_heads, head_dim]."""
