"""Builds the decoder and fills it from *.safetensors (or random weights for `--load-format dummy`).

With tensor parallelism each rank reads only its slices (`safe_open(...).get_slice`): column-parallel
weights by rows, row-parallel ones by columns, the vocabulary by rows (see `pdserve.types.tp_layout`).
A row-parallel bias (o_proj with attention_bias, down_proj with mlp_bias) is added once, by rank 0: the
other ranks hold zeros, since the all-reduce sums the ranks' outputs.
fp8 KV cache scales in the checkpoint (`k_scale`/`v_scale` under their several names) are collected by
`pdserve.model.kv_scales` onto each attention layer; the model runner decides whether they are used.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfig
from pdserve.model.decoder import DecoderLM
from pdserve.model.kv_scales import CheckpointKvScales
from pdserve.model.rope import inverse_frequencies
from pdserve.types.tp_layout import TPShard

if TYPE_CHECKING:
    from pdserve.parallel.comm import TPGroup

log = logging.getLogger(__name__)

# checkpoint name fragment -> (our parameter, shard index among the fused pieces)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_offsets(model: DecoderLM, fused: str) -> list[int]:
    sh, d = model.shard, model.cfg.head_dim
    if fused == "qkv_proj":
        q, kv = sh.heads * d, sh.kv_heads * d
        return [0, q, q + kv, q + 2 * kv]
    return [0, sh.intermediate, 2 * sh.intermediate]


# How each checkpoint weight splits over ranks: (dim, first, end) of this rank's slice, or None (whole).
_Split = tuple[int, int, int] | None


def _split_of(shard: TPShard, head_dim: int, name: str) -> _Split:
    if shard.size == 1:
        return None
    d = head_dim
    parts = name.split(".")
    if "q_proj" in parts:
        return (0, shard.head_start * d, (shard.head_start + shard.heads) * d)
    if "k_proj" in parts or "v_proj" in parts:
        return (0, shard.kv_start * d, (shard.kv_start + shard.kv_heads) * d)
    if "gate_proj" in parts or "up_proj" in parts:
        return (0, shard.inter_start, shard.inter_start + shard.intermediate)
    if parts[-1] == "weight" and "o_proj" in parts:
        return (1, shard.head_start * d, (shard.head_start + shard.heads) * d)
    if parts[-1] == "weight" and "down_proj" in parts:
        return (1, shard.inter_start, shard.inter_start + shard.intermediate)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return (0, shard.vocab_start, shard.vocab_end)
    return None


def _is_row_parallel_bias(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "bias" and ("o_proj" in parts or "down_proj" in parts)


def _read(f: Any, name: str, split: _Split) -> torch.Tensor:
    if split is None:
        return f.get_tensor(name)
    dim, lo, hi = split
    sl = f.get_slice(name)
    return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


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
    tp_shard = model.shard
    if tp_shard.size > 1:
        # the last rank's vocabulary slice may be short: its padding rows stay zero
        model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
    # fp8 KV cache scales (k_scale/v_scale and their other names): per-tensor, so every rank reads them whole
    kv_scales = CheckpointKvScales(model.cfg.num_layers)
    for file in _safetensor_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                target = name.removeprefix("model.")
                if "rotary_emb" in target or kv_scales.offer(target, functools.partial(f.get_tensor, name)):
                    continue
                if target == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue
                if tp_shard.rank > 0 and _is_row_parallel_bias(target):
                    if target not in params:
                        raise ValueError(f"unexpected weight {name!r} in {file.name}")
                    params[target].zero_()  # added by rank 0 only
                    loaded.add(target)
                    continue
                tensor = _read(f, name, _split_of(tp_shard, model.cfg.head_dim, target))
                parts = target.split(".")
                fused = next((p for p in parts if p in _FUSED), None)
                if fused is not None:
                    our, shard = _FUSED[fused]
                    pname = target.replace(fused, our)
                    lo, hi = _fused_offsets(model, our)[shard : shard + 2]
                    params[pname][lo:hi].copy_(tensor)
                    loaded.add(f"{pname}#{shard}")
                    continue
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                if target in ("embed_tokens.weight", "lm_head.weight"):
                    params[target][: tensor.shape[0]].copy_(tensor)
                else:
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
    for layer, scale in zip(model.layers, kv_scales.per_layer(), strict=True):
        layer.self_attn.checkpoint_kv_scale = scale
    if kv_scales.unused:
        log.info("checkpoint attention scales not used (pdserve attends in the model's dtype): %s%s",
                 ", ".join(kv_scales.unused[:2]), " ..." if len(kv_scales.unused) > 2 else "")


@torch.no_grad()
def init_dummy_weights(model: DecoderLM, seed: int) -> None:
    """Random weights in the real shapes: they cost exactly what real weights cost to run (each rank draws
    its own shard)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + 7919 * model.shard.rank)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def build_model(cfg: ModelConfig, model_dir: Path | None, dtype: torch.dtype, device: torch.device,
                load_format: str, seed: int, tp: TPGroup | None = None) -> DecoderLM:
    with torch.device("meta"):
        model = DecoderLM(cfg, tp)
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
