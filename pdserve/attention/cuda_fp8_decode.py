"""The hand-written CUDA decode kernel for fp8 KV caches (csrc/fp8_decode.cu): build, load, launch.

Built the way FlashInfer builds its kernels: from source with the machine's `nvcc`, once per (source hash,
GPU architecture), into a cache directory (`PDSERVE_KERNEL_CACHE`, default ~/.cache/pdserve/kernels); then
loaded with ctypes. The library has one C entry point that takes raw pointers and the stream, so it needs
neither torch's headers nor a matching compiler ABI, and builds in ~20 s. Launched on torch's current stream,
a CUDA graph captures it like any kernel.

Status: NOT YET RUN ON A GPU. It was written in a session without device time: nvcc builds it for sm_90 here
(112 registers, no spills, ~300 instructions per warp per 16-token chunk in the main loop), and a numpy
emulation of its fragment layouts (ldmatrix, mma.m16n8k16, the transposing ldmatrix, the swizzles) matched
plain attention for 1, 2, 4 and 8 heads per KV head; no GPU has run it. So it is opt-in,
`PDSERVE_FP8_DECODE=cuda`, and the Triton kernel stays the default until benchmarks/fp8_decode_cuda.py
(correctness against SDPA, then time against the Triton kernels) has run on the H200.

`usable` says whether a decode call can take it: CUDA, sm_89 or later (the e4m3/e5m2 -> f16x2 conversion
instruction), head_dim 128, up to 8 query heads per KV head, block size a power of two and a multiple of 16,
16-bit queries, and a library that built. Anything else keeps the Triton kernel
(pdserve.attention.triton_kernels.decode_attention), which handles every shape; a failed build is logged
once and leaves the Triton kernel in place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from pdserve.attention import fp8_kv

log = logging.getLogger("pdserve.attention")

SOURCE = Path(__file__).parent / "csrc" / "fp8_decode.cu"
HEAD_DIM = 128
GROUPS = (1, 2, 4, 8)  # query heads per KV head the kernel is instantiated for
STAGES = (2, 3, 4, 6)  # cp.async pipeline depths instantiated (chunks of 16 tokens in flight per warp)
BUILD_TIMEOUT_S = 600.0
# Until measured (see Status above): 3 stages fit 4 CTAs of 4 warps per SM (112 registers, 51 KB of shared
# memory each). Splits aim at 2 CTAs per SM (triton_kernels.decode_num_splits rounds the splits up): batch 64
# of 8 KV heads runs unsplit, 512 CTAs in one wave of 4 x 132 slots on an H200, with no merge kernel; aiming
# at 4 would split it in two (1024 CTAs, two waves and the merge). Batch 8: 5 splits, 320 CTAs.
DEFAULT_STAGES = 3
PROGRAMS_PER_SM = 2

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}  # why an architecture's library is None


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() else None


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    # sm_90a / sm_100a features are not used: plain sm_XY code runs on the GPU it was built for
    return f"sm_{major}{minor}"


def build(arch: str) -> Path:
    """The shared library for `arch` (e.g. sm_90), built now unless the cache has it; raises on failure."""
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, CUDA_HOME)")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + arch.encode()).hexdigest()[:16]
    target = cache_dir() / f"pdserve_fp8_decode_{arch}_{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-diag-suppress", "550",
               "-o", str(built), str(SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders (several instances on one host) both succeed
    return target


def library(device: torch.device) -> ctypes.CDLL | None:
    """The loaded kernel library for `device`'s architecture, or None when it cannot be built (logged once)."""
    arch = _arch(device)
    with _lock:
        if arch not in _libs:
            try:
                lib = ctypes.CDLL(str(build(arch)))
                fn = lib.pdserve_fp8_decode
                fn.restype = ctypes.c_int
                i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
                fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, ptr, ptr,
                               c_int, c_int, c_int, c_int, c_int, ctypes.c_float, c_int, c_int, c_int, ptr]
                _libs[arch] = lib
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
                log.warning("the CUDA fp8 decode kernel is not available (%s); the Triton kernel decodes instead",
                            exc)
                _libs[arch] = None
                _errors[arch] = f"{type(exc).__name__}: {exc}"
        return _libs[arch]


def build_error(device: torch.device) -> str | None:
    """Why `library(device)` is None (after it was asked), else None."""
    return _errors.get(_arch(device))


def selected() -> bool:
    """`PDSERVE_FP8_DECODE=cuda`: decode over fp8 pools with this kernel where `usable` (default: Triton)."""
    return os.environ.get("PDSERVE_FP8_DECODE", "triton").lower() == "cuda"


def usable(q: torch.Tensor, k_cache: torch.Tensor, kv_format: fp8_kv.Fp8Format | None) -> bool:
    """Whether `decode_attention` below can run this call (see the module docstring)."""
    if kv_format is None or not q.is_cuda:
        return False
    _, block_size, kv_heads, row = k_cache.shape
    head_dim = row - fp8_kv.SCALE_BYTES
    if head_dim != HEAD_DIM or q.shape[-1] != HEAD_DIM or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if q.shape[1] % kv_heads or q.shape[1] // kv_heads not in GROUPS or block_size % 16 or block_size & (block_size - 1):
        return False
    return _device_library(q.device.index) is not None


@functools.cache
def _device_library(device_index: int | None) -> ctypes.CDLL | None:
    """`library` for a GPU of sm_89 or later, else None; asked once per device (`usable` and `decode_attention`
    run for every layer of every eager decode step)."""
    device = torch.device("cuda", device_index)
    return library(device) if torch.cuda.get_device_capability(device) >= (8, 9) else None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int, kv_format: fp8_kv.Fp8Format,
                     stages: int = 3, out: torch.Tensor | None = None) -> torch.Tensor:
    """triton_kernels.decode_attention's contract for an fp8 pool (`usable` must be true): q [B, H, 128],
    k_cache / v_cache fp8 layer views [num_blocks, block_size, kv_heads, 130] (uint8), block_tables and
    seq_lens int64 (others are converted; seq_len 0 = a padding row, whose output is 0). With num_splits > 1
    the partial results are merged by triton_kernels' merge kernel."""
    from pdserve.attention import triton_kernels as tk  # the merge kernel; triton is there when CUDA is

    assert stages in STAGES, stages
    # int64 metadata, as the engine's GPU path builds it (pdserve.gpu.step_runner)
    block_tables, seq_lens = block_tables.to(torch.int64), seq_lens.to(torch.int64).contiguous()
    assert block_tables.stride(1) == 1
    assert k_cache.stride(0) == v_cache.stride(0) and k_cache[0].is_contiguous() and v_cache[0].is_contiguous()
    assert q.stride(-1) == 1 and (out is None or (out.dtype == q.dtype and out.stride(-1) == 1))
    batch, num_heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert 1 <= num_splits <= tk.MAX_DECODE_SPLITS
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        part_o = torch.empty((batch, num_heads, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_ptrs = (part_o.data_ptr(), part_lse.data_ptr())
    else:
        part_o = part_lse = None
        part_ptrs = (None, None)
    lib = _device_library(q.device.index)
    assert lib is not None, "decode_attention called where `usable` is false"
    rc = lib.pdserve_fp8_decode(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), out.stride(0),
        out.stride(1), *part_ptrs, batch, num_heads, kv_heads, block_size, num_splits, scale * tk.LOG2E,
        int(q.dtype == torch.bfloat16), int(kv_format.name == "fp8_e5m2"), stages,
        torch.cuda.current_stream(q.device).cuda_stream,
    )
    if rc != 0:
        raise RuntimeError(f"pdserve_fp8_decode failed: {_describe(rc)}")
    if part_o is not None:
        tk.merge_decode_splits(part_o, part_lse, out)
    return out


def _describe(rc: int) -> str:
    if rc == -1:
        return "unsupported query heads per KV head"
    if rc == -2:
        return "unsupported number of stages"
    return f"cudaError {rc}"
