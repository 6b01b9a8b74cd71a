"""Builds pdserve's C kernels (csrc/pdserve_cpu.c) once per machine and loads them with ctypes.

Plain C, no torch headers: gcc builds it in well under a second, so the first engine start pays nothing
noticeable. The shared object is cached under `cache_dir()/cpu_kernels/<key>.so`, the key hashing the
source, the flags, the compiler's version and this CPU's feature flags (`-march=native`). Without a C
compiler (or with `PDSERVE_CPU_KERNELS=0`) `load()` returns None and callers use their torch fallbacks.

torch must be imported first: the library links libgomp by its soname, so the dynamic loader binds it to
the OpenMP runtime torch already loaded and both share one thread pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("pdserve.cpu")

SOURCE = Path(__file__).with_name("csrc") / "pdserve_cpu.c"
_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-ffp-contract=fast"]
_ENV_SWITCH = "PDSERVE_CPU_KERNELS"

_i64 = ctypes.c_int64
_i32 = ctypes.c_int
_f32 = ctypes.c_float
_ptr = ctypes.c_void_p

# name -> argument types (the order of the C signature)
_SIGNATURES: dict[str, list] = {
    "pd_paged_attention": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i32, _i32,
                           _i32, _i32, _i32, _f32, _ptr, _i64, _i32],
    "pd_prefill_attention": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i32, _i32, _i32, _i32, _f32, _ptr, _i64,
                             _i32],
    "pd_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _f32, _i64, _i32, _ptr, _i64, _i32],
    "pd_silu_and_mul": [_ptr, _i64, _i64, _i32, _ptr, _i64, _i32],
    "pd_rope_write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i32, _i32, _i32, _ptr, _ptr,
                         _ptr, _ptr, _i64, _i64, _i64, _ptr, _i32, _i32],
    "pd_omp_runtime": [],
}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(cc: str, arch_flags: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *_FLAGS, *arch_flags, str(SOURCE), "-o", tmp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)  # atomic: concurrent builders (test workers, P and D) never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot be built (the reason is logged once)."""
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        log.info("%s=0: CPU kernels disabled, using the torch paths", _ENV_SWITCH)
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (set CC): CPU kernels disabled, using the slower torch paths")
        return None
    from pdserve.cache_dir import cache_dir  # torch-free; one home for the cache location

    source = SOURCE.read_bytes()
    lib = None
    for arch_flags in (["-march=native"], []):  # a compiler that cannot target this CPU still builds generic
        key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS + arch_flags).encode(), _compiler_version(cc).encode(),
                                         _cpu_flags().encode()])).hexdigest()[:24]
        path = cache_dir() / "cpu_kernels" / f"pdserve_cpu-{key}.so"
        try:
            if not path.is_file():
                _build(cc, arch_flags, path)
            lib = ctypes.CDLL(str(path))
            break
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("building CPU kernels with %s %s failed: %s", cc, " ".join(arch_flags), detail.strip()[-500:])
    if lib is None:
        log.warning("CPU kernels unavailable: using the slower torch paths")
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_void_p if name == "pd_omp_runtime" else None
    if not _shares_torch_openmp(lib):
        # A second OpenMP runtime would mean a second thread pool spinning on the same cores.
        log.warning("CPU kernels bound to an OpenMP runtime other than torch's: disabled, using the torch paths")
        return None
    return lib


def _shares_torch_openmp(lib: ctypes.CDLL) -> bool:
    ours = lib.pd_omp_runtime()
    torch_lib = Path(torch.__file__).parent / "lib"
    for candidate in sorted(torch_lib.glob("libgomp*.so*")):
        with contextlib.suppress(OSError):
            if ctypes.cast(ctypes.CDLL(str(candidate)).omp_get_max_threads, ctypes.c_void_p).value == ours:
                return True
    # A torch build without a bundled libgomp uses the system one, which the library found by soname too.
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.cast(ctypes.CDLL("libgomp.so.1").omp_get_max_threads, ctypes.c_void_p).value == ours
    return False



def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    seq_ids: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Writes the attention of the query rows of sequences `seq_ids` into the same rows of `out`
    (see `pd_paged_attention` in csrc/pdserve_cpu.c for the layout contract)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert block_tables.dtype == query_start_loc.dtype == seq_lens.dtype == seq_ids.dtype == torch.int32
    assert block_tables.stride(1) == 1 and q.dtype == k_cache.dtype == out.dtype == torch.float32
    lib.pd_paged_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        seq_ids.data_ptr(), seq_ids.numel(), num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )


# head sizes pd_prefill_attention has tiles for (others take SDPA)
PREFILL_HEAD_DIMS = (64, 128)


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                      scale: float, out: torch.Tensor) -> None:
    """Causal attention of fresh prompts over their own k/v rows: prompt s owns rows [rows[s, 0], rows[s, 1])
    of q/k/v/out ([T, heads, head_dim], heads contiguous; see `pd_prefill_attention` in csrc/pdserve_cpu.c)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert head_dim in PREFILL_HEAD_DIMS and rows.dtype == torch.int32 and rows.is_contiguous() and rows.shape[1] == 2
    for t in (q, k, v, out):
        assert t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == head_dim
    lib.pd_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), rows.data_ptr(),
        rows.shape[0], num_heads, k.shape[1], head_dim, scale, out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )
