"""The CUDA fp8 decode kernel's host side (pdserve/attention/cuda_fp8_decode.py) on a machine without a GPU: when
it is selected, when a device falls back to the Triton kernel (and says so), what it declines, and (where nvcc is
installed) that its source builds for sm_90 and its C entry point answers through ctypes. Its results are checked on a GPU by pdserve.testing.gpu_correctness
(check_fp8_kernels) and benchmarks/fp8_decode_cuda.py."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.attention import cuda_fp8_decode as cfd
from pdserve.attention import fp8_kv


@pytest.fixture
def fresh_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No device answer cached before or after; a kernel cache of the test's own; the default mode."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("PDSERVE_FP8_DECODE", raising=False)

    def clear() -> None:
        cfd._device_library.cache_clear()
        cfd._ready.clear()
        cfd._libs.clear()
        cfd._errors.clear()

    clear()
    yield
    clear()


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_the_default_is_auto_and_triton_opts_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_FP8_DECODE", raising=False)
    assert cfd.mode() == "auto" and cfd.selected()  # the CUDA kernel wherever it builds and passes its check
    monkeypatch.setenv("PDSERVE_FP8_DECODE", "cuda")
    assert cfd.mode() == "cuda" and cfd.selected()
    monkeypatch.setenv("PDSERVE_FP8_DECODE", "Triton")
    assert cfd.mode() == "triton" and not cfd.selected()
    monkeypatch.setenv("PDSERVE_FP8_DECODE", "fast")
    with pytest.raises(ValueError, match="PDSERVE_FP8_DECODE='fast'"):
        cfd.selected()


def test_a_gpu_before_sm89_falls_back_with_a_log_line(monkeypatch: pytest.MonkeyPatch, fresh_devices: None,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    _gpu(monkeypatch, (8, 0))
    monkeypatch.setattr(cfd, "library", lambda device: pytest.fail("no build for a GPU that cannot run it"))
    with caplog.at_level(logging.INFO, logger="pdserve.attention"):
        assert cfd._device_library(0) is None
        assert cfd._device_library(0) is None  # asked once per device
    lines = [r for r in caplog.records if "fp8 KV decode" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "the Triton kernel" in lines[0].getMessage() and "sm_80" in lines[0].getMessage()
    assert 0 in cfd._ready


def test_no_nvcc_falls_back_and_a_forced_cuda_warns(monkeypatch: pytest.MonkeyPatch, fresh_devices: None,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    _gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(cfd, "_nvcc", lambda: None)
    monkeypatch.setenv("PDSERVE_FP8_DECODE", "cuda")
    with caplog.at_level(logging.INFO, logger="pdserve.attention"):
        assert not cfd.prepare(torch.device("cuda", 0))
    (line,) = [r for r in caplog.records if "fp8 KV decode" in r.getMessage()]
    assert line.levelno == logging.WARNING and "nvcc not found" in line.getMessage()
    assert "nvcc not found" in (cfd.build_error(torch.device("cuda", 0)) or "")


@pytest.mark.parametrize("worst", [0.004, 0.5, float("nan")])
def test_taken_only_after_its_own_check_passes(monkeypatch: pytest.MonkeyPatch, fresh_devices: None,
                                               caplog: pytest.LogCaptureFixture, worst: float) -> None:
    _gpu(monkeypatch, (9, 0))
    built = object()
    checked: list[object] = []
    monkeypatch.setattr(cfd, "library", lambda device: built)

    def self_check(device: torch.device, lib: object) -> float:
        checked.append(lib)
        return worst

    monkeypatch.setattr(cfd, "self_check", self_check)
    with caplog.at_level(logging.INFO, logger="pdserve.attention"):
        got = cfd._device_library(1)
    assert checked == [built]
    (line,) = [r.getMessage() for r in caplog.records if "fp8 KV decode" in r.getMessage()]
    if worst < cfd.SELF_CHECK_TOL:
        assert got is built and "the CUDA kernel (built and checked)" in line
    else:
        assert got is None and "self-check failed" in line and "the Triton kernel" in line


def test_a_check_that_raises_falls_back(monkeypatch: pytest.MonkeyPatch, fresh_devices: None) -> None:
    _gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(cfd, "library", lambda device: object())

    def self_check(device: torch.device, lib: object) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cfd, "self_check", self_check)
    assert cfd._device_library(0) is None
    assert "illegal memory access" in (cfd.build_error(torch.device("cuda", 0)) or "")


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
