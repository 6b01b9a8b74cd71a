"""Builds the decoder and fills it from *.safetensors (or random weights for `--load-format dummy`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfig
from pdserve.model.decoder import DecoderLM
from pdserve.model.rope import inverse_frequencies

# checkpoint name fragment -> (our parameter, shard index among the fused pieces)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_offsets(model: DecoderLM, fused: str) -> list[int]:
    cfg = model.cfg
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [0, q, q + kv, q + 2 * kv]
    return [0, cfg.intermediate_size, 2 * cfg.intermediate_size]


def _safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir} has no *.safetensors weights (use --load-format dummy for random weights)"
        )
    return files


@torch.no_grad()
def load_weights(model: DecoderLM, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in _safetensor_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                target = name.removeprefix("model.")
                if "rotary_emb" in target:
                    continue
                tensor = f.get_tensor(name)
                parts = target.split(".")
                fused = next((p for p in parts if p in _FUSED), None)
                if fused is not None:
                    our, shard = _FUSED[fused]
                    pname = target.replace(fused, our)
                    lo, hi = _fused_offsets(model, our)[shard : shard + 2]
                    params[pname][lo:hi].copy_(tensor)
                    loaded.add(f"{pname}#{shard}")
                    continue
                if target == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                params[target].copy_(tensor)
                loaded.add(target)
    missing = []
    for pname in params:
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f in pname), None)
        if fused is None:
            if pname not in loaded and not (pname == "lm_head.weight" and model.cfg.tie_word_embeddings):
                missing.append(pname)
            continue
        shards = 3 if fused == "qkv_proj" else 2
        missing += [f"{pname}#{s}" for s in range(shards) if f"{pname}#{s}" not in loaded]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


@torch.no_grad()
def init_dummy_weights(model: DecoderLM, seed: int) -> None:
    """Random weights in the real shapes: they cost exactly what real weights cost to run."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def build_model(cfg: ModelConfig, model_dir: Path | None, dtype: torch.dtype, device: torch.device,
                load_format: str, seed: int) -> DecoderLM:
    with torch.device("meta"):
        model = DecoderLM(cfg)
    # Allocate directly in the target dtype: an 8B model never exists in float32.
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        assert model_dir is not None
        load_weights(model, model_dir)
    # RoPE frequencies stay float32 whatever the weights' dtype, as in HF.
    model.rotary.inv_freq = inverse_frequencies(cfg).to(device)
    return model.eval()
