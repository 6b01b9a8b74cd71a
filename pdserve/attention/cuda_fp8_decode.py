"""The hand-written CUDA decode kernel for fp8 KV caches (csrc/fp8_decode.cu): build, load, launch.

Built the way FlashInfer builds its kernels: from source with the machine's `nvcc`, once per (source hash,
GPU architecture), into a cache directory (`PDSERVE_KERNEL_CACHE`, default ~/.cache/pdserve/kernels); then
loaded with ctypes. The library has one C entry point that takes raw pointers and the stream, so it needs
neither torch's headers nor a matching compiler ABI, and builds in ~20 s. Launched on torch's current stream,
a CUDA graph captures it like any kernel.

Default on CUDA (`PDSERVE_FP8_DECODE` unset or `auto`): on the H200 it is correct in all 144 cases of
benchmarks/fp8_decode_cuda.py and the 64 CUDA rows of gpu_correctness's fp8 kernel checks, and faster than the
Triton fp8 kernel at every batch measured (BENCHMARKS.md, FP8 KV cache, run 7).
On each device it is taken only once it has built AND passed its own check (`self_check`: random fp8 pools
against SDPA over the dequantized pool, at warm-up, outside any graph capture); where nvcc is missing, the GPU
is older than sm_89, the build fails or the check fails, one log line says why and the Triton kernel decodes.
`PDSERVE_FP8_DECODE=triton` keeps the Triton kernel; `cuda` is `auto` with the fallback logged as a warning.

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
# Measured on the H200 (issue 36): 3 stages fit 4 CTAs of 4 warps per SM (112 registers, 51 KB of shared
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
    """The loaded kernel library for `device`'s architecture, or None when it cannot be built (`build_error` says
    why; `_device_library` logs it). Not checked: decode takes it through `usable` / `prepare`."""
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
                _libs[arch] = None
                _errors[arch] = f"{type(exc).__name__}: {exc}"
        return _libs[arch]


def build_error(device: torch.device) -> str | None:
    """Why `library(device)` is None (after it was asked), else None."""
    return _errors.get(_arch(device))


MODES = ("auto", "cuda", "triton")
SELF_CHECK_TOL = 2e-2  # 16-bit queries: the products run in float16 (the Triton fp8 kernel's tolerance too)
# (query heads, KV heads, sequence lengths): GQA groups 4 and 1, a 1-token sequence, ragged tails
SELF_CHECK_CASES = ((32, 8, (1, 17, 300)), (8, 8, (33, 129)))


def mode() -> str:
    """`PDSERVE_FP8_DECODE`: auto (default: this kernel where it builds and passes its check), cuda (the same,
    a fallback logged as a warning), triton (the Triton kernel always)."""
    value = os.environ.get("PDSERVE_FP8_DECODE", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"PDSERVE_FP8_DECODE={value!r}: expected one of {', '.join(MODES)}")
    return value


def selected() -> bool:
    """Whether fp8 decode tries this kernel at all (everything but PDSERVE_FP8_DECODE=triton)."""
    return mode() != "triton"


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
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _ready and torch.cuda.is_current_stream_capturing():
        return False  # never build or check inside a capture (warm_up prepares it before any graph)
    return _device_library(index) is not None


_ready: set[int] = set()  # devices whose answer `_device_library` has cached


def prepare(device: torch.device) -> bool:
    """Build, load and check the kernel for `device` now (the backend's warm-up); whether decode will use it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_library(index) is not None


@functools.cache
def _device_library(device_index: int) -> ctypes.CDLL | None:
    """`library` for a GPU of sm_89 or later whose `self_check` passed, else None with one log line saying why;
    asked once per device (`usable` and `decode_attention` run for every layer of every eager decode step)."""
    device = torch.device("cuda", device_index)
    try:
        lib, why = _checked_library(device)
    finally:
        _ready.add(device_index)
    if lib is None:
        level = logging.WARNING if mode() == "cuda" else logging.INFO
        log.log(level, "fp8 KV decode on %s: the Triton kernel (the CUDA kernel is not used: %s)", device, why)
    else:
        log.info("fp8 KV decode on %s: the CUDA kernel (built and checked)", device)
    return lib


def _checked_library(device: torch.device) -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return None, f"sm_{capability[0]}{capability[1]} has no e4m3/e5m2 conversion instruction (sm_89 or later)"
    lib = library(device)
    if lib is None:
        return None, build_error(device) or "the build failed"
    try:
        worst = self_check(device, lib)
    except RuntimeError as exc:  # a launch error: the kernel cannot serve here
        _errors[_arch(device)] = f"self-check raised {exc}"
        return None, _errors[_arch(device)]
    if not worst < SELF_CHECK_TOL:
        _errors[_arch(device)] = f"self-check failed: relative error {worst:.3g} vs SDPA (limit {SELF_CHECK_TOL:g})"
        return None, _errors[_arch(device)]
    return lib, ""


def self_check(device: torch.device, lib: ctypes.CDLL) -> float:
    """The worst relative error of the built kernel against float32 SDPA over the dequantized pool, on small
    random fp8 batches of both formats, unsplit and split (poisoned outputs: a row left unwritten fails)."""
    from pdserve.attention.paged_reference import SdpaReference, fp8_case, make_paged_case, rel_err

    ref = SdpaReference(torch.float32)
    worst = 0.0
    for n, (heads, kv_heads, seqs) in enumerate(SELF_CHECK_CASES):
        case = make_paged_case([1] * len(seqs), list(seqs), heads, kv_heads, HEAD_DIM, device=device, seed=36 + n)
        for name in ("fp8_e4m3", "fp8_e5m2"):
            fmt = fp8_kv.fp8_format(name)
            c8, cf = fp8_case(case, name)
            want = ref.forward(cf.q, cf.k_cache, cf.v_cache, cf.meta, HEAD_DIM**-0.5).float()
            for splits in (1, 3):
                out = torch.full_like(c8.q, float("nan"))
                _launch(lib, c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables,
                        c8.meta.seq_lens, HEAD_DIM**-0.5, splits, fmt, DEFAULT_STAGES, out)
                worst = max(worst, rel_err(out, want))
    torch.cuda.synchronize(device)
    return worst


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int, kv_format: fp8_kv.Fp8Format,
                     stages: int = DEFAULT_STAGES, out: torch.Tensor | None = None) -> torch.Tensor:
    """triton_kernels.decode_attention's contract for an fp8 pool (`usable` must be true): q [B, H, 128],
    k_cache / v_cache fp8 layer views [num_blocks, block_size, kv_heads, 130] (uint8), block_tables and
    seq_lens int64 (others are converted; seq_len 0 = a padding row, whose output is 0). With num_splits > 1
    the partial results are merged by triton_kernels' merge kernel."""
    lib = _device_library(q.device.index if q.device.index is not None else torch.cuda.current_device())
    assert lib is not None, "decode_attention called where `usable` is false"
    return _launch(lib, q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, kv_format, stages, out)


def _launch(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
            kv_format: fp8_kv.Fp8Format, stages: int, out: torch.Tensor | None) -> torch.Tensor:
    from pdserve.attention import triton_kernels as tk  # the merge kernel; triton is there when CUDA is

    assert stages in STAGES, stages
    # int64 metadata, as the engine's GPU path builds it (pdserve.engine.runner.step_runner)
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
