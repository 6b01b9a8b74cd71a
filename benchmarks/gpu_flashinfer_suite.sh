#!/usr/bin/env bash
# Issue 21 on one H200 in one run: our prefill attention (triton, triton-cudnn) beside FlashInfer on the same
# paged pool and torch's cuDNN/flash SDPA on contiguous K/V; FlashInfer's decode beside ours; the fresh
# 8192-token prompt's path taken apart; long-prompt TTFT with each backend in one engine
# (`--attention-backend flashinfer`, which can switch its prefill between FlashInfer and Triton).
#
# usage, from the repo root on a GPU machine without FlashInfer installed:
#   WHEELS=DIR OUT=DIR bash benchmarks/gpu_flashinfer_suite.sh
# DIR holds flashinfer_python-0.7.4 (repacked by slim_wheels.py to fit a 64 MiB transfer), apache_tvm_ffi and
# cuda_tile cp312 wheels, optionally fi-jit-cache.tgz (FlashInfer's compiled kernels from an earlier run: skips
# ~1 min of nvcc per kernel). Writes $OUT/gpu_suite.{json,md}, $OUT/log.txt and $OUT/fi-jit-cache.tgz.
set -uo pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH=$PWD:$SITE FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$(mktemp -d)}
if [ -f "$WHEELS/fi-jit-cache.tgz" ]; then tar xzf "$WHEELS/fi-jit-cache.tgz" -C "$FLASHINFER_WORKSPACE_BASE"; fi
SKIP=correctness_kernels,kernel_sweeps,correctness_8b,correctness_engines,p1_decode_b1,decode_b1_variants
SKIP=$SKIP,p2_decode_b64_2k,p2_no_prefix_cache,host_profile_b256,prefill_8x1024,long_context_131000,offline
SKIP=$SKIP${EXTRA_SKIP:+,$EXTRA_SKIP}
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --out "$OUT" --attention-backend flashinfer \
  --budget-s "${BUDGET_S:-480}" --skip "$SKIP" 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
# the compiled modules only (no build intermediates), for the next run's WHEELS dir
(cd "$FLASHINFER_WORKSPACE_BASE" && find .cache -name '*.so' -print0 | tar czf "$OUT/fi-jit-cache.tgz" --null -T -)
exit "$rc"
