"""One decoder family for Llama, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm): they differ only by flags.

Two forward paths over the same weights: plain torch ops (CPU, and the GPU reference), and on CUDA the
fused path (`DecoderLM.fused_ops` set to `pdserve.gpu.ops` on CUDA, to `pdserve.cpu.ops.CpuOps` on CPU): one
kernel each for residual-add + RMSNorm, RoPE + K/V store and SiLU-and-mul, rounding where the torch path
rounds; and its linear layers through `ops.linear` (on CUDA a GEMV kernel for one-token steps).

Tensor parallelism (`tp`, a `pdserve.parallel.comm.TPGroup`; None = one rank, and then no collective runs):
the modules hold this rank's shard (`pdserve.parallel.layout.TPShard`): qkv and gate_up column-parallel,
o_proj and down_proj row-parallel followed by an all-reduce, embedding and LM head vocab-parallel (a masked
lookup summed over ranks; logits gathered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention.base import AttentionBackend, AttentionMetadata, KvScale
from pdserve.model.config import ModelConfig
from pdserve.model.rope import RotaryEmbedding, apply_rotary
from pdserve.parallel.layout import TPShard

if TYPE_CHECKING:
    from pdserve.parallel.comm import TPGroup


def shard_of(cfg: ModelConfig, tp: TPGroup | None) -> TPShard:
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    return TPShard(rank, size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)


class FusedOps(Protocol):
    """What the fused path calls (the module pdserve.gpu.ops, or a pdserve.cpu.ops.CpuOps)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor: ...

    def rope_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, block_size: int,
                          kv_scale: KvScale | None = None) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF: normalise in float32, cast back, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        shard = shard_of(cfg, tp)
        self.tp = tp
        self.num_heads = shard.heads
        self.num_kv_heads = shard.kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # q, k and v fused into one matmul; the loader concatenates the checkpoint's three weights.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        # the checkpoint's per-tensor k_scale/v_scale, if it has them (the loader sets this); the model
        # runner copies them to kv_scale for an fp8 pool (pdserve.model.kv_scales)
        self.checkpoint_kv_scale: KvScale | None = None
        self.kv_scale: KvScale | None = None  # what the K/V stores quantize with (None: per-row scales)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        backend.write_kv(k_cache, v_cache, k, v, meta, kv_scale=self.kv_scale)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self._out(o)

    def _out(self, o: torch.Tensor, ops: FusedOps | None = None) -> torch.Tensor:
        flat = o.reshape(-1, self.q_size)
        out = ops.linear(flat, self.o_proj) if ops is not None else self.o_proj(flat)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def forward_fused(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend,
                      ops: FusedOps) -> torch.Tensor:
        qkv = ops.linear(x, self.qkv_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        # RoPE on q and k and the K/V store in one kernel; q comes back contiguous.
        q = ops.rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, meta.block_size,
                                  kv_scale=self.kv_scale)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self._out(o, ops)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: silu")
        self.tp = tp
        self.intermediate = shard_of(cfg, tp).intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)

    def down(self, h: torch.Tensor, ops: FusedOps | None = None) -> torch.Tensor:
        out = ops.linear(h, self.down_proj) if ops is not None else self.down_proj(h)
        return self.tp.all_reduce(out) if self.tp is not None else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.shard = shard_of(cfg, tp)
        vocab = self.shard.vocab_per_rank  # the whole vocabulary with one rank
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # pdserve.gpu.ops on CUDA (set by the GPU step runner), CpuOps on CPU (the model runner); None = the
        # plain torch path
        self.fused_ops: FusedOps | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden]. kv_pool is the block-contiguous pool
        [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
        x = self._embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if self.fused_ops is not None:
            return self._forward_fused(x, cos, sin, kv_pool, meta, backend, self.fused_ops)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_pool[:, i, 0], kv_pool[:, i, 1], meta, backend)
        return self.norm(x)

    def _forward_fused(self, x, cos, sin, kv_pool, meta, backend, ops: FusedOps) -> torch.Tensor:
        # `residual` carries the stream x_i; each fused_add_rms_norm adds the last block's output to it
        # in place and normalises, so the adds round exactly where DecoderLayer.forward's adds round.
        eps = self.cfg.rms_norm_eps
        residual = x
        h = ops.rms_norm(x, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            if i > 0:
                h, residual = ops.fused_add_rms_norm(x, residual, layer.input_layernorm.weight, eps)
            a = layer.self_attn.forward_fused(h, cos, sin, kv_pool[:, i, 0], kv_pool[:, i, 1], meta, backend, ops)
            h, residual = ops.fused_add_rms_norm(a, residual, layer.post_attention_layernorm.weight, eps)
            x = layer.mlp.down(ops.silu_and_mul(ops.linear(h, layer.mlp.gate_up_proj)), ops)
        out, _ = ops.fused_add_rms_norm(x, residual, self.norm.weight, eps)
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: each rank looks up the ids in its slice, zeros elsewhere; the sum over ranks has
        # exactly one non-zero term per token, so it equals the unsharded lookup bit for bit.
        lo, hi = self.shard.vocab_start, self.shard.vocab_end
        outside = (input_ids < lo) | (input_ids >= hi)
        x = self.embed_tokens((input_ids - lo).masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ops = self.fused_ops
        logits = (ops.linear(hidden, self.lm_head) if ops is not None else self.lm_head(hidden)).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., : self.cfg.vocab_size]
