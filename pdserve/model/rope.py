"""Rotary position embeddings as Hugging Face computes them (default, linear and llama3 scaling)."""

from __future__ import annotations

import math

import torch

from pdserve.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp in between.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # computed on the CPU whatever the default device: under the loader's meta device, the arithmetic runs
        # through torch._refs, whose first call imports torch._dynamo (~3.5 CPU-s of every process start)
        with torch.device("cpu"):
            self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 like HF, then cast to the activation dtype.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin_rows(self, positions: torch.Tensor, dtype: torch.dtype,
                     length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin(positions) as rows gathered from a table of positions [0, length) (one kernel where
        computing them takes seven: a batch-1 decode graph's nodes count, issue 21). The table is cos_sin of
        arange(length) on the same device, elementwise, so the rows are the same bits. Returns strided views
        (last dim contiguous, cos.stride() == sin.stride()). The table is made on first use, outside any CUDA
        graph capture (the step runner's warm-up forward precedes each capture); during a capture without
        one, the rows are computed."""
        t = getattr(self, "_table", None)
        if t is None or t.shape[0] < length or t.dtype != dtype or t.device != positions.device:
            if positions.is_cuda and torch.cuda.is_current_stream_capturing():
                return self.cos_sin(positions, dtype)
            cos, sin = self.cos_sin(torch.arange(length, device=positions.device), dtype)
            t = self._table = torch.stack((cos, sin), dim=1)  # [length, 2, D]
        rows = t.index_select(0, positions)
        return rows[:, 0], rows[:, 1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
