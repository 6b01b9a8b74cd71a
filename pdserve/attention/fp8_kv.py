"""FP8 KV cache: `--kv-cache-dtype` names, the in-block byte layout, quantize on write, dequantize on read.

Names and meaning follow vLLM (vllm/config/cache.py `CacheDType`): `auto` stores KV in the model's dtype;
`fp8` is `fp8_e4m3` (OCP E4M3FN, max 448); `fp8_e5m2` has more range and less precision (max 57344).

Scales. vLLM keeps one per-tensor `k_scale`/`v_scale` per layer (from the checkpoint or 1.0) and its
NixlConnector does not move dynamic scales. pdserve computes scales at write time, one per (token, KV head)
row, and stores each next to its row, inside the block's own bytes. The pool of an fp8 cache is uint8:

    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 2]
     row bytes 0..head_dim-1: the fp8 values; bytes head_dim..head_dim+1: the row's bfloat16 scale

so block `i` is still one contiguous byte range holding its data and its scales together (one NIXL
descriptor per block moves both), and prefix-cached blocks stay self-describing. Why per row rather than
per block: decode appends one token at a time, so a block-wide scale would have to be fixed at the first
write (later, larger values clipped) or the block re-quantized on every append; a per-row scale is
written once with its row and never changes. The cost is 2 bytes per head_dim fp8 bytes (1.6% of an fp8
row at head_dim 128, 3.1% at 64): 1.97x (head_dim 128) or 1.94x (64) the blocks of a 16-bit pool.

The scale is rounded to bfloat16 *before* the values are divided by it, so reading back multiplies by
exactly the factor used when writing (the rounding of the scale costs nothing); a value that the rounded
scale pushes past the fp8 maximum is clamped to it (at most 2^-8 relative, on the row's largest entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import KV_FP8_SCALE_BYTES, canonical_kv_cache_dtype

SCALE_BYTES = KV_FP8_SCALE_BYTES  # one bfloat16 per (token, kv head) row
SCALE_SCHEME = "per-token-head-bf16-inline"  # what the handshake's compat dict calls this layout


@dataclass(frozen=True)
class Fp8Format:
    name: str  # canonical: fp8_e4m3 | fp8_e5m2
    dtype: torch.dtype
    max: float

    def row_bytes(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES


_FORMATS = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),
    "fp8_e5m2": Fp8Format("fp8_e5m2", torch.float8_e5m2, float(torch.finfo(torch.float8_e5m2).max)),
}


def fp8_format(name: str) -> Fp8Format | None:
    """The fp8 format a `--kv-cache-dtype` value selects, None for `auto` (the model's dtype)."""
    return _FORMATS.get(canonical_kv_cache_dtype(name))


def split_rows(raw: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 cache view [..., head_dim + 2] as (fp8 values [..., head_dim], bfloat16 scales [..., 1])."""
    head_dim = raw.shape[-1] - SCALE_BYTES
    return raw[..., :head_dim].view(fmt.dtype), raw[..., head_dim:].view(torch.bfloat16)


def quantize_rows(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> uint8 rows [..., head_dim + 2] (fp8 values, then the scale)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    # Round the scale first, then divide by the rounded value: dequantizing multiplies by the same number.
    scale = (amax / fmt.max).clamp_min(1e-30).to(torch.bfloat16)
    values = (x32 / scale.float()).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(raw: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., head_dim + 2] -> values [..., head_dim] in `dtype`."""
    values, scale = split_rows(raw, fmt)
    return (values.float() * scale.float()).to(dtype)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """Store quantized rows [num_tokens, kv_heads, head_dim + 2] at their slots of a uint8 layer view
    [num_blocks, block_size, kv_heads, head_dim + 2]."""
    block = torch.div(slot_mapping, block_size, rounding_mode="floor")
    cache[block, slot_mapping - block * block_size] = rows
