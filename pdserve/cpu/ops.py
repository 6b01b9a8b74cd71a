"""DecoderLM's fused-op interface (the one `pdserve.engine.runner.gpu_ops` implements with Triton) on the CPU kernels.

Each op replaces 5-10 torch ops, and as many Python dispatches, per layer: RMSNorm with the residual
add, RoPE on q and k with the K/V store, SiLU-and-mul. Element-wise arithmetic rounds as the torch path
does; the RMS sum and SiLU's exp differ in the last bit (as the GPU kernels do).
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch


class NewKVSink(Protocol):
    """Where the fused K/V store reports the rows it wrote (attention.cpu_paged.CpuPagedAttention: fresh prompts
    attend over them). A protocol, so that cpu/ does not import attention/, which imports cpu/."""

    def remember_new_kv(self, k: torch.Tensor, v: torch.Tensor) -> None: ...


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class CpuOps:
    def __init__(self, lib: ctypes.CDLL, backend: NewKVSink):
        self.lib = lib
        self.backend = backend  # fresh prompts attend over the rotated k rows rope_and_write_kv makes

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.lib.pd_rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), eps, x.shape[0], x.shape[1],
                             out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- residual + x (in place); returns (rms_norm(residual) * weight, residual)."""
        x = _rows(x)
        assert residual.stride(-1) == 1
        out = torch.empty(x.shape, dtype=x.dtype)
        self.lib.pd_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                             eps, x.shape[0], x.shape[1], out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out, residual

    def linear(self, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        return layer(x)  # the packed oneDNN linears (pdserve.cpu.packed_linear) are already the fast path

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, 2 * n] = [gate | up] -> silu(gate) * up, [rows, n]."""
        x = _rows(x)
        n = x.shape[1] // 2
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        self.lib.pd_silu_and_mul(x.data_ptr(), x.stride(0), x.shape[0], n, out.data_ptr(), out.stride(0),
                                 torch.get_num_threads())
        return out

    def rope_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, block_size: int, kv_scale=None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (strided views of the fused qkv output are fine); cos/sin: [T, D].
        Returns rotated q ([T, H, D] contiguous); rotated k and v go to their slots. These ops serve float
        pools only (the model runner installs them for none other), so there is no fp8 kv_scale to apply."""
        assert kv_scale is None, "the fused CPU K/V store writes float pools only"
        num_tokens, num_heads, d = q.shape
        kv_heads = k.shape[1]
        q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == d else t.contiguous() for t in (q, k, v))
        assert cos.is_contiguous() and sin.is_contiguous() and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(-1) == 1 and slot_mapping.dtype == torch.int64
        q_out = torch.empty((num_tokens, num_heads, d), dtype=q.dtype)
        k_out = torch.empty((num_tokens, kv_heads, d), dtype=q.dtype)
        self.lib.pd_rope_write_kv(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
            sin.data_ptr(), cos.stride(0), num_tokens, num_heads, kv_heads, d, q_out.data_ptr(), k_out.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            slot_mapping.data_ptr(), block_size, torch.get_num_threads(),
        )
        self.backend.remember_new_kv(k_out, v)
        return q_out
