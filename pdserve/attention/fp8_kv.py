"""FP8 KV cache: `--kv-cache-dtype` names, the in-block byte layout, quantize on write, dequantize on read.

Names and meaning follow vLLM (vllm/config/cache.py `CacheDType`): `auto` stores KV in the model's dtype;
`fp8` is `fp8_e4m3` (OCP E4M3FN, max 448); `fp8_e5m2` has more range and less precision (max 57344).

Scales. vLLM keeps one per-tensor `k_scale`/`v_scale` per layer (from the checkpoint or 1.0) and its
NixlConnector does not move dynamic scales. pdserve computes scales at write time, one per (token, KV head)
row, and stores them inside the block's own bytes. The pool of an fp8 cache is uint8, allocated as

    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 2]

but the trailing `[block_size, num_kv_heads, head_dim + 2]` of each (block, layer, K|V) only sizes that
region's bytes; they are laid out head-major, values first, scales after them (`SCALE_SCHEME`):

    K: bytes [0, kv_heads * block_size * head_dim)     fp8 values  [kv_heads, block_size, head_dim]
    V: bytes [0, kv_heads * block_size * head_dim)     fp8 values  [kv_heads, head_dim, block_size]
    then bytes [kv_heads * block_size * head_dim, region) bf16 scales [kv_heads, block_size]

Never index such a pool by token or head directly: `layer_views(cache, is_v)` gives the two typed views (V's
values view is the transposed storage seen as [kv_heads, block_size, head_dim]). Why this layout:
- every fp8 value row starts 16-byte aligned (the region is block_size x kv_heads x (head_dim + 2) bytes,
  a multiple of 16 for block sizes of 8 or more), so the Triton kernels load K/V tiles with 16-byte
  (`cp.async`) copies like the bf16 kernels; rows of head_dim + 2 bytes with the scale inline were only
  2-byte aligned, which made fp8 decode slower than bf16 (BENCHMARKS.md, FP8 KV cache);
- V dim-major (each head_dim row holds the block's tokens): in p . v the tokens are the reduction dimension,
  and the matrix-product operand wants it contiguous. A token-major 8-bit V tile had to be moved into that
  operand layout one byte at a time (sm_90 has no transposing 8-bit shared-memory load): 128 shared loads and
  ~100 byte permutes per thread per 128-token tile, the largest part of the fp8 decode loop's instructions.
  Dim-major, V loads like K (ldmatrix, no byte moves): the kernel went from 212 to 135 us at b64 / 4k on the
  H200 (with the hardware e4m3 conversion and a register cap, BENCHMARKS.md);
- block `i` is still one contiguous byte range holding its data and its scales (one NIXL descriptor per
  block moves both), and prefix-cached blocks stay self-describing;
- head-major: one KV head's values in one region are one contiguous piece (block_size x head_dim bytes) and
  its scales another, so the tensor-parallel handoff moves a head range with two strided descriptors per
  run of blocks (`pdserve.kv_transfer.head_split`), and a decode tile reads each block's rows of its head
  as one run.

Every byte of a pool is 0 (pools are zero-allocated) or a code a writer stored (values clamped to the
format's max, so never a NaN code): the GPU kernels read the tail of a sequence's last V block past its end
with whole rows and give it probability 0, which a NaN code would defeat (0 * NaN).

Why per row rather than per block: decode appends one token at a time, so a block-wide scale would have to
be fixed at the first write (later, larger values clipped) or the block re-quantized on every append; a
per-row scale is written once with its row and never changes. A checkpoint's per-tensor `k_scale`/`v_scale`
(pdserve.model.kv_scales) only changes what the writers put into the scale slots: every row of that layer
holds the static scale; the layout and the readers stay as they are. The cost is 2 bytes per head_dim fp8 bytes
(1.6% at head_dim 128, 3.1% at 64): 1.97x (head_dim 128) or 1.94x (64) the blocks of a 16-bit pool.

The scale is rounded to bfloat16 *before* the values are divided by it, so reading back multiplies by
exactly the factor used when writing (the rounding of the scale costs nothing); a value that the rounded
scale pushes past the fp8 maximum is clamped to it (at most 2^-8 relative, on the row's largest entry).
The Triton writers (`pdserve.attention.triton_fp8`) store the same bytes as `write` here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.types.engine_config import KV_FP8_SCALE_BYTES, canonical_kv_cache_dtype

SCALE_BYTES = KV_FP8_SCALE_BYTES  # one bfloat16 per (token, kv head) row
# what the handshake's compat dict calls this layout; the earlier layouts were "per-token-head-bf16-inline" and
# "per-token-head-bf16-head-major-tail" (V token-major), which a peer of this version refuses (different bytes
# in the same sizes)
SCALE_SCHEME = "per-token-head-bf16-head-major-v-dim-major-tail"


@dataclass(frozen=True)
class Fp8Format:
    name: str  # canonical: fp8_e4m3 | fp8_e5m2
    dtype: torch.dtype
    max: float

    def row_bytes(self, head_dim: int) -> int:
        """Bytes per (token, kv head) in the pool (the last dimension of its allocation shape)."""
        return head_dim + SCALE_BYTES


_FORMATS = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),
    "fp8_e5m2": Fp8Format("fp8_e5m2", torch.float8_e5m2, float(torch.finfo(torch.float8_e5m2).max)),
}


def fp8_format(name: str) -> Fp8Format | None:
    """The fp8 format a `--kv-cache-dtype` value selects, None for `auto` (the model's dtype)."""
    return _FORMATS.get(canonical_kv_cache_dtype(name))


def region_geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, kv_heads, head_dim) of an fp8 cache view [..., block_size, kv_heads, head_dim + 2]."""
    block_size, kv_heads, row = cache.shape[-3:]
    return int(block_size), int(kv_heads), int(row) - SCALE_BYTES


def scales_offset(block_size: int, kv_heads: int, head_dim: int) -> int:
    """Byte offset of the scales inside a (block, layer, K|V) region: right after the values."""
    return kv_heads * block_size * head_dim


def layer_views(cache: torch.Tensor, is_v: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cache view uint8 [..., block_size, kv_heads, head_dim + 2] (one region per leading index, e.g.
    a layer's `pool[:, layer, 0|1]`) as (values uint8 [..., kv_heads, block_size, head_dim], scales bfloat16
    [..., kv_heads, block_size]): views of the same bytes, for reading and writing. is_v: the regions are V's,
    whose values are stored dim-major ([kv_heads, head_dim, block_size]; the view transposes them back)."""
    assert cache.dtype == torch.uint8
    block_size, kv_heads, d = region_geometry(cache)
    flat = cache.flatten(-3)  # the region's bytes (each region is contiguous)
    n = scales_offset(block_size, kv_heads, d)
    if is_v:
        values = flat[..., :n].unflatten(-1, (kv_heads, d, block_size)).transpose(-1, -2)
    else:
        values = flat[..., :n].unflatten(-1, (kv_heads, block_size, d))
    scales = flat[..., n:].view(torch.bfloat16).unflatten(-1, (kv_heads, block_size))
    return values, scales


def static_kv_scale(scale: float) -> float:
    """A checkpoint's per-tensor k_scale or v_scale as the bfloat16 value the scale slots hold (what the
    writers divide by, so reading back multiplies by exactly the divisor; relative change at most 2^-9)."""
    return float(torch.tensor(scale, dtype=torch.float32).to(torch.bfloat16))


def quantize(x: torch.Tensor, fmt: Fp8Format, static_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (fp8 values as uint8 [..., head_dim], bfloat16 scales [...]).
    static_scale: a checkpoint's per-tensor k_scale or v_scale (a `static_kv_scale` value) for every row,
    instead of each row's own amax / fp8 max."""
    x32 = x.float()
    if static_scale is None:
        amax = x32.abs().amax(dim=-1, keepdim=True)
        # Round the scale first, then divide by the rounded value: dequantizing multiplies by the same number.
        scale = (amax / fmt.max).clamp_min(1e-30).to(torch.bfloat16)
    else:
        scale = torch.full((*x32.shape[:-1], 1), static_scale, device=x.device).to(torch.bfloat16)
    values = (x32 / scale.float()).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return values.view(torch.uint8), scale.squeeze(-1)


def dequantize(values: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """uint8 fp8 values [..., head_dim] and their bfloat16 scales [...] -> [..., head_dim] in `dtype`."""
    return (values.view(fmt.dtype).float() * scales.float().unsqueeze(-1)).to(dtype)


def write(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
          fmt: Fp8Format, static_scale: float | None = None, *, is_v: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows x [num_tokens, kv_heads, head_dim] (with `static_scale` if given) and store them at
    their slots of an fp8 layer view [num_blocks, block_size, kv_heads, head_dim + 2] (K's, or V's with
    is_v). Returns what was stored: (values, scales)."""
    values, scales = quantize(x, fmt, static_scale)
    cache_values, cache_scales = layer_views(cache, is_v)
    block = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offset = slot_mapping - block * block_size
    # (block, :, offset) with a slice between two index tensors: the token dimension comes first, [T, heads, ...]
    cache_values[block, :, offset] = values
    cache_scales[block, :, offset] = scales
    return values, scales


def quantize_blocks(x: torch.Tensor, fmt: Fp8Format, static_scale: float | None = None, *,
                    is_v: bool) -> torch.Tensor:
    """A float layer view (or a slice of one) [..., block_size, kv_heads, head_dim] of K (or of V with is_v)
    -> the fp8 regions holding its quantized rows, uint8 [..., block_size, kv_heads, head_dim + 2] (same
    bytes as `write`)."""
    out = torch.empty((*x.shape[:-1], fmt.row_bytes(x.shape[-1])), dtype=torch.uint8, device=x.device)
    values, scales = layer_views(out, is_v)
    q, s = quantize(x.transpose(-3, -2), fmt, static_scale)  # [..., kv_heads, block_size, ...]
    values.copy_(q)
    scales.copy_(s)
    return out


def dequantize_blocks(cache: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype, *, is_v: bool) -> torch.Tensor:
    """fp8 regions of K (or of V with is_v) [..., block_size, kv_heads, head_dim + 2] -> their values in
    `dtype` as a float layer view [..., block_size, kv_heads, head_dim] (contiguous)."""
    values, scales = layer_views(cache, is_v)
    x = dequantize(values, scales, fmt, dtype).transpose(-3, -2)
    # a fresh tensor, not .contiguous(): with one kv head that would keep V's transposed stride on the size-1
    # head axis, and the CPU kernel asks K and V for equal strides
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def quantize_pool(pool: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """A whole float pool [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] -> its fp8 pool (K
    and V regions each in their own layout)."""
    return torch.stack([quantize_blocks(pool[:, :, kv], fmt, is_v=kv == 1) for kv in (0, 1)], dim=2)


def dequantize_pool(pool: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """quantize_pool's inverse: an fp8 pool -> the float pool of its values in `dtype`."""
    return torch.stack([dequantize_blocks(pool[:, :, kv], fmt, dtype, is_v=kv == 1) for kv in (0, 1)], dim=2)
