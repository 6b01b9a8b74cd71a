"""A checkpoint's per-tensor fp8 KV cache scales (`k_scale` / `v_scale`), as vLLM reads them.

Quantized checkpoints (llm-compressor / compressed-tensors, NVIDIA ModelOpt, AMD Quark) carry one float per
layer for K and one for V: the cache stores fp8(x / k_scale) and reads fp8 * k_scale. They name them
differently; vLLM maps them all onto `...self_attn.attn.k_scale` / `v_scale` (vllm/model_executor/
model_loader/weight_utils.py `maybe_remap_kv_scale_name`, and the quantization configs' `get_cache_scale`,
e.g. compressed_tensors.py). Recognized here, per layer `model.layers.N.self_attn.`:

    k_scale, v_scale                        compressed-tensors (llm-compressor's current output)
    attn.k_scale, attn.v_scale              vLLM's own parameter names
    k_proj.k_scale, v_proj.v_scale          ModelOpt
    k_proj.output_scale, v_proj.output_scale   compressed-tensors (older) and Quark
    kv_scale, attn.kv_scale                 deprecated single scale: used for both K and V

Resolution follows vLLM's BaseKVCacheMethod.process_weights_after_loading (vllm/model_executor/layers/
quantization/kv_cache.py): both present -> used as they are; only one (or the single kv_scale) -> it is
duplicated to the other; a scale that is not one number is refused ("only per-tensor"). Where vLLM falls
back to 1.0 for a layer without scales, pdserve keeps its own per-(token, head) scales computed at write
time (better than an uncalibrated 1.0). `--kv-cache-dtype auto` ignores the scales, as vLLM does.

q_scale / prob_scale (`q_proj.output_scale`, `prob_output_scale`) only matter to vLLM's fp8 *attention*
backends; pdserve attends in the model's dtype, so they are read past.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.attention import fp8_kv
from pdserve.attention.base import KvScale

if TYPE_CHECKING:
    from pdserve.model.decoder import DecoderLM

log = logging.getLogger(__name__)

_LAYER_ATTN = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(.+)$")
# the part of the name after `self_attn.` -> which scale it is ("" = an fp8-attention scale, not used)
_SUFFIXES = {
    "k_scale": "k", "attn.k_scale": "k", "k_proj.k_scale": "k", "k_proj.output_scale": "k",
    "v_scale": "v", "attn.v_scale": "v", "v_proj.v_scale": "v", "v_proj.output_scale": "v",
    "kv_scale": "kv", "attn.kv_scale": "kv",
    "q_scale": "", "attn.q_scale": "", "q_proj.output_scale": "", "prob_scale": "", "attn.prob_scale": "",
    "prob_output_scale": "",
}


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv" | "") for a checkpoint tensor that is an attention scale ("": one pdserve
    does not use), None for any other tensor."""
    m = _LAYER_ATTN.match(name)
    if m is None or m.group(2) not in _SUFFIXES:
        return None
    return int(m.group(1)), _SUFFIXES[m.group(2)]


class CheckpointKvScales:
    """Collects the scale tensors while the loader walks a checkpoint; `per_layer()` resolves them."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._found: dict[int, dict[str, float]] = {}
        self.unused: list[str] = []

    def offer(self, name: str, read: Callable[[], torch.Tensor]) -> bool:
        """True when `name` is an attention scale (then read and kept, or noted as unused)."""
        target = kv_scale_name(name)
        if target is None:
            return False
        layer, which = target
        if not which:
            self.unused.append(name)
            return True
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"KV cache scale {name!r} names layer {layer}; the model has {self.num_layers}")
        tensor = read()
        if tensor.numel() != 1:
            raise ValueError(f"KV cache scale {name!r} has shape {tuple(tensor.shape)}: only per-tensor scales "
                             "(one number per layer) are supported for the fp8 KV cache, as in vLLM")
        value = float(tensor.float().item())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV cache scale {name!r} is {value}: a scale must be a positive finite number")
        self._found.setdefault(layer, {})[which] = value
        return True

    def per_layer(self) -> list[KvScale | None]:
        """(k_scale, v_scale) per layer as the checkpoint gives them, None where it has none."""
        out: list[KvScale | None] = []
        for layer in range(self.num_layers):
            got = self._found.get(layer, {})
            k, v = got.get("k"), got.get("v")
            if k is None and v is None:
                k = v = got.get("kv")  # the deprecated single scale serves both
            elif k is None or v is None:
                # vLLM duplicates the one it has (max(k_scale, v_scale) with -1 for the missing one)
                k = v = k if k is not None else v
            out.append(None if k is None else (k, v))
        return out


def use_checkpoint_kv_scales(model: DecoderLM, fp8_format: fp8_kv.Fp8Format | None) -> str:
    """Sets each attention layer's static K/V scales for an fp8 pool from the checkpoint's (rounded to the
    bfloat16 the rows' scale slots hold) and says which scales the KV cache uses: `none` (not quantized),
    `dynamic` (per (token, head) at write time), `checkpoint` (static per-tensor, every layer) or
    `checkpoint+dynamic` (static where the checkpoint has them)."""
    attns = [layer.self_attn for layer in model.layers]
    have = [a.checkpoint_kv_scale for a in attns]
    with_scales = sum(s is not None for s in have)
    if fp8_format is None:
        for a in attns:
            a.kv_scale = None
        if with_scales:
            log.info("KV cache in the model's dtype (--kv-cache-dtype auto): the checkpoint's k_scale/v_scale "
                     "(%d of %d layers) are ignored", with_scales, len(attns))
        return "none"
    for a, scale in zip(attns, have, strict=True):
        a.kv_scale = None if scale is None else (fp8_kv.static_kv_scale(scale[0]), fp8_kv.static_kv_scale(scale[1]))
    if not with_scales:
        log.info("fp8 KV cache (%s): scales computed per (token, KV head) at write time (the checkpoint has no "
                 "k_scale/v_scale)", fp8_format.name)
        return "dynamic"
    first = next(a.kv_scale for a in attns if a.kv_scale is not None)
    if with_scales < len(attns):
        log.warning("fp8 KV cache (%s): static per-tensor k_scale/v_scale from the checkpoint for %d of %d "
                    "layers; the others compute per-(token, KV head) scales at write time",
                    fp8_format.name, with_scales, len(attns))
        return "checkpoint+dynamic"
    log.info("fp8 KV cache (%s): static per-tensor k_scale/v_scale from the checkpoint for all %d layers "
             "(first layer's: k %.6g, v %.6g, as bfloat16)", fp8_format.name, len(attns), *first)
    return "checkpoint"
