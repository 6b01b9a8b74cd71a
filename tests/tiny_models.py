"""Tiny random-weight Llama / Qwen2 / Qwen3 models saved with save_pretrained (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320


def make_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0, vocab_size: int = VOCAB,
                    max_position_embeddings: int = 1024, tie: bool = False, rope_scaling: dict | None = None,
                    **overrides) -> Path:
    """overrides: config fields (e.g. num_key_value_heads=1, attention_bias=True) over the tiny defaults."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_scaling=rope_scaling)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32)  # head_dim != hidden/heads, as real Qwen3 has
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():
        # Larger-than-default init so greedy argmaxes have clear margins and outputs vary by prompt.
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.08)
            if "bias" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir
