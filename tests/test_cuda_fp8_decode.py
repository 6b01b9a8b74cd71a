"""The CUDA fp8 decode kernel's host side (pdserve/attention/cuda_fp8_decode.py) on a machine without a GPU: when
it is selected, what it declines, and (where nvcc is installed) that its source builds for sm_90 and its C entry
point answers through ctypes. Its results are checked on a GPU by pdserve.testing.gpu_correctness
(check_fp8_kernels) and benchmarks/fp8_decode_cuda.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from pdserve.attention import cuda_fp8_decode as cfd
from pdserve.attention import fp8_kv


def test_selected_only_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_FP8_DECODE", raising=False)
    assert not cfd.selected()  # the Triton kernel until the CUDA one is measured
    monkeypatch.setenv("PDSERVE_FP8_DECODE", "cuda")
    assert cfd.selected()
    monkeypatch.setenv("PDSERVE_FP8_DECODE", "triton")
    assert not cfd.selected()


def test_declines_cpu_tensors_and_16_bit_pools() -> None:
    fmt = fp8_kv.fp8_format("fp8_e4m3")
    q = torch.zeros((2, 32, 128), dtype=torch.bfloat16)
    cache = torch.zeros((4, 16, 8, 128 + fp8_kv.SCALE_BYTES), dtype=torch.uint8)
    assert not cfd.usable(q, cache, fmt)  # not CUDA: the caller keeps the Triton kernel
    assert not cfd.usable(q, cache, None)  # a 16-bit pool


@pytest.mark.skipif(cfd._nvcc() is None, reason="nvcc is not installed")
def test_builds_for_sm90_and_answers_through_ctypes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    path = cfd.build("sm_90")
    assert path.parent == tmp_path and path.name.startswith("pdserve_fp8_decode_sm_90_")
    assert cfd.build("sm_90") == path  # cached by source hash: no second build
    lib = ctypes.CDLL(str(path))
    fn = lib.pdserve_fp8_decode
    fn.restype = ctypes.c_int

    def call(num_heads: int, kv_heads: int, stages: int) -> int:
        # the argument checks answer before any CUDA call, so this runs without a GPU
        return fn(None, ctypes.c_int64(0), ctypes.c_int64(0), None, None, ctypes.c_int64(0), None, ctypes.c_int64(0),
                  None, None, ctypes.c_int64(0), ctypes.c_int64(0), None, None, 1, num_heads, kv_heads, 16, 1,
                  ctypes.c_float(1.0), 1, 0, stages, None)

    assert call(num_heads=28, kv_heads=4, stages=3) == -1  # 7 query heads per KV head: not instantiated
    assert call(num_heads=32, kv_heads=8, stages=5) == -2  # no 5-stage pipeline
