"""What `--attention-backend flashinfer` decides before its kernels run, importable without CUDA or Triton (so
CPU CI checks it): the optional package, the start-up checks, which steps go to FlashInfer, and the
page-table inputs FlashInfer plans a step from. The backend itself is pdserve/attention/flashinfer_backend.py."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.attention import long_prefill as lp
from pdserve.attention.base import AttentionMetadata

PACKAGE = "flashinfer-python"
PINNED_VERSION = "0.7.4"  # the version measured on the H200 (pyproject.toml's `flashinfer` extra)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Steps whose longest query run is at most this stay on the Triton kernels (decode rows, tiny chunks):
# FlashInfer would pick its FA2 kernel for them, a second JIT module, for work our kernel does well.
TRITON_MAX_Q = 64
# ... and so do steps with less attention work per layer than this (FLOPs): FlashInfer's plan costs 1.1-1.5 ms
# of host time per step, during which the GPU idles, and its kernel saves ~1.1e-15 s per FLOP over ours (368
# vs 260 TFLOP/s at B=8, q 512 of kv 2048, the H200 run in BENCHMARKS.md). Break-even over 32 layers is
# ~4e10 FLOPs per layer; this keeps ~1.5x margin (the saving at smaller shapes was not measured).
FLASHINFER_MIN_LAYER_FLOPS = 6e10


def import_flashinfer():
    """The flashinfer module, or a ValueError naming the package to install (raised at engine start-up)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - missing, or broken (a CUDA library it links against): same advice
        raise ValueError(
            f"--attention-backend flashinfer needs the {PACKAGE} package, which is not importable here "
            f"({type(e).__name__}: {e}); "
            f"install it with `pip install {PACKAGE}=={PINNED_VERSION}` (or pdserve's `flashinfer` extra) on a "
            "CUDA machine with nvcc, or use --attention-backend auto") from None
    return flashinfer


def check_usable(device: torch.device, dtype: torch.dtype | None, kv_format) -> None:
    """Start-up checks beyond the import: what this backend cannot serve, said before any request."""
    if device.type != "cuda":
        raise ValueError("--attention-backend flashinfer needs a CUDA device")
    if kv_format is not None:
        raise ValueError("--attention-backend flashinfer reads a bf16/fp16 KV pool; an fp8 KV cache "
                         "(--kv-cache-dtype fp8*) needs --attention-backend triton or auto")
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"--attention-backend flashinfer runs bf16/fp16 models, not {dtype}; "
                         "use --dtype bfloat16 or --attention-backend auto")


def paged_plan_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """FlashInfer's page-table description of a step, from the host-side lengths (no device sync):
    qo_indptr, kv page indptr and last-page lengths as int32 CPU tensors, and each sequence's page
    positions in the flattened [num_seqs, width] block table (to gather its page ids on the device)."""
    bs = meta.block_size
    q_lens = np.asarray(meta.query_lens_host, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)
    pages = (seq_lens + bs - 1) // bs
    qo_indptr = np.zeros(len(q_lens) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qo_indptr[1:])
    kv_indptr = np.zeros(len(pages) + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    last_page_len = (seq_lens - (pages - 1) * bs).astype(np.int32)
    width = meta.block_tables.shape[1]
    rows = np.repeat(np.arange(len(pages), dtype=np.int64) * width, pages)
    positions = rows + (np.arange(int(kv_indptr[-1]), dtype=np.int64) - np.repeat(kv_indptr[:-1], pages))
    return (torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), torch.from_numpy(last_page_len), positions)


def step_attention_flops(meta: AttentionMetadata, num_heads: int, head_dim: int) -> float:
    """Causal attention FLOPs of one layer of a step (QK^T and PV), from the host-side lengths."""
    q = np.asarray(meta.query_lens_host, dtype=np.int64)
    s = np.asarray(meta.seq_lens_host, dtype=np.int64)
    return 4.0 * num_heads * head_dim * float((q * (s - q) + q * (q + 1) // 2).sum())


def takes_flashinfer(meta: AttentionMetadata, long_prefill: lp.LongPrefillConfig | None, num_heads: int,
                     head_dim: int, min_layer_flops: float = FLASHINFER_MIN_LAYER_FLOPS) -> bool:
    """Whether a step's attention runs on FlashInfer's paged prefill: a prefill step with a query run longer
    than TRITON_MAX_Q and enough attention work to pay for FlashInfer's per-step plan, unless one of its
    chunks is long enough for the long-prefill path (long_prefill set: cuDNN partials finished by Triton,
    measured faster than FlashInfer on such chunks)."""
    if meta.decode_only or meta.verify_rows or meta.max_query_len <= TRITON_MAX_Q:  # verify graphs: Triton's
        return False
    if min_layer_flops and step_attention_flops(meta, num_heads, head_dim) < min_layer_flops:
        return False
    if long_prefill is None or meta.max_query_len < long_prefill.min_q:
        return True
    return not lp.plan_chunks(meta, long_prefill.min_q, long_prefill.ctx_align, long_prefill.q_bucket)
