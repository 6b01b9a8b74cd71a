"""One decoder family for Llama, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm): they differ only by flags.

Two forward paths over the same weights: plain torch ops (CPU, and the GPU reference), and on CUDA the
fused path (`DecoderLM.fused_ops` set to `pdserve.engine.runner.gpu_ops` on CUDA, to `pdserve.cpu.ops.CpuOps` on CPU): one
kernel each for residual-add + RMSNorm, RoPE + K/V store and SiLU-and-mul, rounding where the torch path
rounds; and its linear layers through `ops.linear` (on CUDA a GEMV kernel for one-token steps).

Tensor parallelism (`tp`, a `pdserve.parallel.comm.TPGroup`; None = one rank, and then no collective runs):
the modules hold this rank's shard (`pdserve.types.tp_layout.TPShard`): qkv and gate_up column-parallel,
o_proj and down_proj row-parallel followed by an all-reduce, embedding and LM head vocab-parallel (a masked
lookup summed over ranks; logits gathered).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention.base import AttentionBackend, AttentionMetadata, KvScale
from pdserve.model.config import ModelConfig
from pdserve.model.rope import RotaryEmbedding, apply_rotary
from pdserve.types.tp_layout import TPShard

if TYPE_CHECKING:
    from pdserve.parallel.comm import TPGroup


def shard_of(cfg: ModelConfig, tp: TPGroup | None) -> TPShard:
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    return TPShard(rank, size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)


class FusedOps(Protocol):
    """What the fused path calls (the module pdserve.engine.runner.gpu_ops, or a pdserve.cpu.ops.CpuOps)."""

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

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend,
                on_kv: Callable[[], None] | None = None):
        """on_kv: called once this layer's K/V of the step is stored (layer-pipelined push), before attention."""
        q, k, v = self._split_heads(self.qkv_proj(x))
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        backend.write_kv(k_cache, v_cache, k, v, meta, kv_scale=self.kv_scale)
        if on_kv is not None:
            on_kv()
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        return self._out(o)

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused qkv projection's output -> q [T, H, D], k and v [T, KVH, D] (strided views), with Qwen3's
        per-head q/k RMSNorm applied."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return q, k, v

    def _out(self, o: torch.Tensor, ops: FusedOps | None = None) -> torch.Tensor:
        """o_proj (+ the all-reduce of a row-parallel shard); o: [T, H, D] or [T, H * D]."""
        flat = o.reshape(-1, self.q_size)
        out = ops.linear(flat, self.o_proj) if ops is not None else self.o_proj(flat)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def forward_fused(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend,
                      ops: FusedOps) -> torch.Tensor:
        return self._out(self.attend_fused(x, cos, sin, k_cache, v_cache, meta, backend, ops), ops)

    def attend_fused(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend,
                     ops: FusedOps, on_kv: Callable[[], None] | None = None) -> torch.Tensor:
        """The fused path up to the attention output [T, H, D] (o_proj is the caller's); on_kv as in forward."""
        q = None
        fused_qkv = getattr(ops, "qkv_rope_and_write_kv", None)
        if fused_qkv is not None and self.q_norm is None and self.kv_scale is None:
            # one token: RoPE and the K/V store in the qkv GEMV's epilogue (None where that does not apply)
            q = fused_qkv(x, self.qkv_proj, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, k_cache,
                          v_cache, meta.slot_mapping, meta.block_size)
        if q is None:
            q, k, v = self._split_heads(ops.linear(x, self.qkv_proj))
            # RoPE on q and k and the K/V store in one kernel; q comes back contiguous.
            q = ops.rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, meta.block_size,
                                      kv_scale=self.kv_scale)
        if on_kv is not None:
            on_kv()
        return backend.forward(q, k_cache, v_cache, meta, self.scale)


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

    def activated(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        """silu(gate) * up of the fused path: for one token in the gate_up GEMV's epilogue where the ops
        have it."""
        fused = getattr(ops, "gate_up_silu", None)
        out = fused(x, self.gate_up_proj) if fused is not None else None
        return out if out is not None else ops.silu_and_mul(ops.linear(x, self.gate_up_proj))

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

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend, on_kv: Callable[[], None] | None = None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, backend, on_kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.shard = shard_of(cfg, tp)
        vocab = self.shard.vocab_per_rank  # the whole vocabulary with one rank
        # An uninitialised weight (the loader fills it): nn.Embedding's own random init, under the loader's meta
        # device, runs through torch._refs and imports torch._dynamo (~3.5 CPU-s of every process start).
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size, _weight=torch.empty(vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # pdserve.engine.runner.gpu_ops on CUDA (set by the GPU step runner), CpuOps on CPU (the model runner); None = the
        # plain torch path
        self.fused_ops: FusedOps | None = None
        self._scratch: torch.Tensor | None = None  # the fused ops' epilogue counters, made on first use
        # positions below this come from a cos/sin table (RotaryEmbedding.cos_sin_rows; the GPU step runner
        # sets it to max_model_len); None: computed per step
        self.rope_table_len: int | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden]. kv_pool is the block-contiguous pool
        [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]. `on_layer(i)` runs as soon as layer
        i's K/V store of this step is issued, before its attention (layer-pipelined push transfer: on a GPU the
        callback records an event there, so the layer's WRITE can overlap the rest of the layer)."""
        x = self._embed(input_ids)
        if self.rope_table_len and positions.is_cuda:
            cos, sin = self.rotary.cos_sin_rows(positions, x.dtype, self.rope_table_len)
        else:
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if self.fused_ops is not None:
            return self._forward_fused(x, cos, sin, kv_pool, meta, backend, self.fused_ops, on_layer)
        # With one rank the callback runs right after the layer's K/V store. With tensor parallelism it runs
        # after the whole layer: the other ranks' WRITEs of layer i may only start once their K/V store of it
        # ran, and the layer's all-reduces order every rank's store before this rank passes them.
        early = on_layer is not None and self.tp is None
        for i, layer in enumerate(self.layers):
            on_kv = functools.partial(on_layer, i) if early else None
            x = layer(x, cos, sin, kv_pool[:, i, 0], kv_pool[:, i, 1], meta, backend, on_kv)
            if on_layer is not None and not early:
                on_layer(i)
        return self.norm(x)

    def _forward_fused(self, x, cos, sin, kv_pool, meta, backend, ops: FusedOps,
                       on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        # `residual` carries the stream x_i; each fused_add_rms_norm adds the last block's output to it
        # in place and normalises, so the adds round exactly where DecoderLayer.forward's adds round.
        # With one token on one rank, o_proj and down_proj may do that add and norm in their last program
        # (ops.linear_add_rms_norm); the op order and rounding stay the same.
        eps = self.cfg.rms_norm_eps
        residual = x
        h = ops.rms_norm(x, self.layers[0].input_layernorm.weight, eps)
        n = len(self.layers)
        early = on_layer is not None and self.tp is None  # as in forward
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            on_kv = functools.partial(on_layer, i) if early else None
            o = attn.attend_fused(h, cos, sin, kv_pool[:, i, 0], kv_pool[:, i, 1], meta, backend, ops, on_kv)
            h, residual = self._project_add_norm(ops, o.reshape(-1, attn.q_size), attn.o_proj, attn._out, residual,
                                                 layer.post_attention_layernorm.weight, eps)
            norm_next = self.layers[i + 1].input_layernorm.weight if i + 1 < n else self.norm.weight
            h, residual = self._project_add_norm(ops, mlp.activated(h, ops), mlp.down_proj, mlp.down, residual,
                                                 norm_next, eps)
            if on_layer is not None and not early:
                on_layer(i)
        return h

    def _project_add_norm(self, ops: FusedOps, x: torch.Tensor, proj: nn.Linear, project, residual: torch.Tensor,
                          weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """fused_add_rms_norm(project(x), residual): one launch where the ops have linear_add_rms_norm
        (one row, one rank); `project` is the module's own projection (with its all-reduce) otherwise."""
        fused = getattr(ops, "linear_add_rms_norm", None)
        if fused is not None and self.tp is None:
            scratch = self._epilogue_scratch(ops, x.device)
            got = fused(x, proj, residual, weight, eps, None if scratch is None else scratch[2:3])
            if got is not None:
                return got
        return ops.fused_add_rms_norm(project(x, ops), residual, weight, eps)

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

    def logits_and_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits, argmax token ids) of the last hidden states. One row on one rank: the argmax
        runs in the LM head GEMV's epilogue where the fused ops have it (a decode graph's last kernels)."""
        ops = self.fused_ops
        fused = getattr(ops, "lm_head_argmax", None)
        if fused is not None and self.tp is None and hidden.shape[0] == 1:
            scratch = self._epilogue_scratch(ops, hidden.device)
            got = fused(hidden, self.lm_head, None if scratch is None else scratch[0:2])
            if got is not None:
                return got
        logits = self.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _epilogue_scratch(self, ops: FusedOps, device: torch.device) -> torch.Tensor | None:
        """The fused epilogues' persistent counters (their kernels leave them at rest). Made outside graph
        capture (the step runner's warm-up forward precedes every capture); None during a capture without
        one, or where the ops have none."""
        s = self._scratch
        if s is None or s.device != device:
            make = getattr(ops, "new_epilogue_scratch", None)
            if make is None or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                return None
            s = self._scratch = make(device)
        return s
