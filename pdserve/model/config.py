"""The subset of a Hugging Face config.json that the decoder needs, for Llama, Qwen2 and Qwen3."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    torch_dtype: str  # as written in config.json ("float32", "bfloat16", ...)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """Per element size is applied by the caller; this is elements per token across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    return parse_model_config(json.loads(path.read_text()))


def parse_model_config(cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    # transformers 5 nests rope settings under rope_parameters; 4.x uses rope_theta + rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_scaling = cfg.get("rope_scaling")
    if rope_params and rope_params.get("rope_type", "default") != "default":
        rope_scaling = dict(rope_params)
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind == "default":
            rope_scaling = None
        elif kind not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        torch_dtype=str(dtype).replace("torch.", ""),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
    )


# vLLM's escape hatch (vllm/config/model.py, _get_and_verify_max_len): a --max-model-len above what the
# model's config allows is refused unless this is set to 1.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def derived_max_model_len(max_position_embeddings: int, rope_scaling: dict[str, Any] | None = None) -> int:
    """The context length the model's config supports: max_position_embeddings, times the factor of a
    linear RoPE scaling (llama3 scaling's max_position_embeddings is already the scaled one), as vLLM does."""
    factor = 1.0
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind not in ("default", "su", "longrope", "llama3"):
            factor = float(rope_scaling.get("factor", 1.0))
    return int(max_position_embeddings * factor)


def verify_max_model_len(requested: int | None, derived: int, env: dict[str, str] | None = None) -> int:
    """The max_model_len to use: `derived` when none is requested; a requested one above `derived` is a
    ValueError unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (then a warning: positions beyond the trained ones
    give garbage)."""
    if requested is None:
        return derived
    if requested < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {requested}")
    if requested <= derived:
        return requested
    msg = (f"--max-model-len {requested} is greater than the model's maximum context length ({derived}, from "
           f"max_position_embeddings in its config.json)")
    if (os.environ if env is None else env).get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "").lower() in ("1", "true"):
        logging.getLogger("pdserve").warning(
            "%s; allowed by %s=1: positions beyond the trained ones give meaningless output", msg,
            ALLOW_LONG_MAX_MODEL_LEN_ENV)
        return requested
    raise ValueError(f"{msg}. To allow it anyway, set the environment variable {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 "
                     "(positions beyond the trained ones give meaningless output)")
