"""Everything the GPU path must show, in one device call: ceilings, correctness, kernel sweeps, engine
benchmarks. Writes $OUT/gpu_suite.json (all numbers) and $OUT/gpu_suite.md, and prints a short table last.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_suite.py --out $OUT [--offline-prompts 1000] [--budget-s 540]
        [--skip NAME,...] [--only NAME,...]   # sections by name; `env` and `ceilings` always run

Ceilings are measured in the same run: bf16 8192^3 torch matmul (TFLOP/s) and a 1 GiB device-to-device
copy. Copy bandwidth is reported two ways: bytes read + bytes written per second (METHOD.md's convention,
what the memory system delivers; the primary ceiling here) and bytes copied per second (half of it).

Benchmarks on Llama-3.1-8B in its real shapes with random weights (`--load-format dummy`), bf16:
- P1 decode, batch 1: weight bytes read per step / ITL vs copy bandwidth (goal >= 85%).
- P2 decode, batch 64, 2k context: (weight + KV bytes read per step) / step time vs copy bandwidth
  (goal >= 75%).
- P3 prefill, 8192 tokens in one step: model FLOPs / time vs matmul TFLOP/s (goal >= 65%).
- Offline throughput: N prompts of 1024 in / 512 out: tokens/s and the CPU's share of step time.
- Long context (issue 21): TTFT of one 8k / 32k / 64k / 131k-token prompt, chunked at 8192, with the
  attention backend's long-prefill path off (`triton`) and on (`triton-cudnn`), FLOPs counting causal
  attention (goals: >= 75 % of matmul at 32k, >= 72 % and <= 3.8 s at 64k).
- Prefill attention (issue 21): our kernels on the paged pool against torch SDPA's cuDNN and flash
  backends on contiguous K/V and, where the optional flashinfer package imports, FlashInfer's paged prefill
  on the same pool, for the same shapes (goal >= 90 % of the best), with correctness checks; FlashInfer's
  paged decode beside ours. `--attention-backend flashinfer` builds the engine sections on that backend and
  adds its modes to them (benchmarks/gpu_flashinfer_suite.sh carries FlashInfer and runs this).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLASHINFER_H200 = {  # ../shared/reference/h200-facts.md (the team notes), measured with our pool layout
    "decode_b8_kv2048_us": 54.7,
    "decode_b8_kv2048_us_pool_view_tuple": 50.6,
    "prefill_b8_q512_kv2048_tflops_sm90": 406.0,
    "prefill_b8_q512_kv2048_tflops_fa2": 286.0,
}


# sections that run before the engine is built; any other section named in --only builds it (`engine_init`)
PRE_ENGINE = frozenset({"env", "ceilings", "prefill_attention", "fresh_prompt_breakdown", "decode_flashinfer_vs_triton",
                        "correctness_kernels", "kernel_sweeps", "correctness_8b", "correctness_engines"})
ALWAYS = frozenset({"env", "ceilings"})  # the same-run ceilings every ratio needs


class Suite:
    def __init__(self, out: Path, budget_s: float, skip: set[str] | None = None, only: set[str] | None = None):
        self.out = out
        self.skip = skip or set()
        self.only = only  # None: every section not skipped
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        (self.out / "gpu_suite.json").write_text(json.dumps(self.results, indent=1, default=str))

    def section(self, name: str, fn, *args, min_left_s: float = 0.0, **kwargs) -> Any:
        if name in self.skip or (self.only is not None and name not in self.only and name not in ALWAYS):
            return None
        if self.left() < min_left_s:
            self.results[name] = {"skipped": f"time budget: {self.left():.0f} s left, needs {min_left_s:.0f}"}
            print(f"== {name}: skipped (time)", flush=True)
            self.save()
            return None
        print(f"== {name} ({self.left():.0f} s left)", flush=True)
        t = time.perf_counter()
        try:
            res = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others' numbers
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
        if isinstance(res, dict):
            res.setdefault("section_seconds", round(time.perf_counter() - t, 1))
        self.results[name] = res
        self.save()
        gc.collect()
        torch.cuda.empty_cache()
        print(f"   {name} done in {time.perf_counter() - t:.1f} s", flush=True)
        return res


# ---------------------------------------------------------------------------------------------------
# timing helpers
# ---------------------------------------------------------------------------------------------------
def time_cuda(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_us(fn) -> float:
    """Median microseconds; triton's do_bench clears L2 between calls (launch gaps can count)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def graph_us(fn) -> float:
    """Median microseconds of fn replayed from a CUDA graph: the device time alone."""
    import triton.testing

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")) * 1e3


# ---------------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------------
def env_info() -> dict[str, Any]:
    import triton

    p = torch.cuda.get_device_properties(0)
    info = {
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "device": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
        "python": sys.version.split()[0],
    }
    with contextlib.suppress(Exception):
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    return info


def _matmul_seconds(n: int) -> float:
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)  # random data: zeros run faster
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    return time_cuda(lambda: a @ b, warmup=3, iters=10)


def _copy_seconds(nbytes: int) -> float:
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src), warmup=3, iters=10)


def ceilings() -> dict[str, Any]:
    n = 8192
    res: dict[str, Any] = {"matmul_bf16_8192_tflops": 2 * n**3 / _matmul_seconds(n) / 1e12}
    for gib in (1, 4):
        nbytes = gib * 2**30
        t = _copy_seconds(nbytes)
        res[f"copy_{gib}gib_rw_GBps"] = 2 * nbytes / t / 1e9
        res[f"copy_{gib}gib_oneway_GBps"] = nbytes / t / 1e9
    # the ceilings every ratio below uses
    res["copy_rw_GBps"] = res["copy_1gib_rw_GBps"]
    res["copy_oneway_GBps"] = res["copy_1gib_oneway_GBps"]
    return res


def correctness_kernels() -> dict[str, Any]:
    from pdserve.testing.gpu_correctness import check_kernels, check_ops

    k = check_kernels()
    o = check_ops()
    return {"kernels": k, "ops": o, "ok": all(r["ok"] for r in k + o),
            "worst_attention_rel_err": max(r.get("rel_err", 0.0) for r in k)}


def correctness_engines() -> dict[str, Any]:
    from pdserve.testing.gpu_correctness import check_engines_tiny

    r = check_engines_tiny()
    return {"archs": r, "ok": all(x["ok"] for x in r)}


def correctness_8b() -> dict[str, Any]:
    from pdserve.testing.gpu_correctness import check_8b_logits

    return check_8b_logits()


def _attention_flops(heads: int, d: int, q_lens: list[int], seq_lens: list[int]) -> float:
    """Causal: query j of a sequence sees ctx + j + 1 keys; QK^T and PV are 2 flops per MAC each."""
    keys = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens, strict=True))
    return 4.0 * heads * d * keys


def kernel_sweeps() -> dict[str, Any]:
    from pdserve.attention import triton_backend as tb
    from pdserve.attention import triton_kernels as tk
    from pdserve.testing.gpu_correctness import make_paged_case

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict[str, Any] = {"decode": [], "prefill": []}
    h, kvh, d = 32, 8, 128
    # ---- decode, over an 8-layer pool through strided per-layer views, as the engine reads it.
    # Timed two ways: do_bench (one layer, launch gaps included: how FlashInfer's 54.7 us was taken, as
    # far as we know) and a CUDA graph of the kernel over all 8 layers (no launch gaps, L2 not reused:
    # what a decode step sees), which picks the configs.
    dec_cfgs = [(32, 4, 3), (64, 4, 3), (64, 4, 2), (128, 8, 3), (32, 8, 3)]  # (tile_n, warps, stages)
    pps_opts = (1, 2, 4, 8)  # programs per SM targeted by the split count
    best_by_batch: dict[int, tuple[int, int, int, int]] = {}
    for batch, kv in ((8, 2048), (1, 2048), (64, 2048), (256, 1024)):
        c = make_paged_case([1] * batch, [kv] * batch, h, kvh, d, num_layers=8, seed=batch)
        kv_bytes = batch * kv * kvh * d * 2 * 2
        layers = [(c.pool[:, i, 0], c.pool[:, i, 1]) for i in range(8)]
        rows = []
        for tile_n, warps, stages in dec_cfgs:
            for pps in pps_opts:
                splits = tk.decode_num_splits(batch, kvh, sms, pps)
                row = {"batch": batch, "kv": kv, "tile_n": tile_n, "warps": warps, "stages": stages, "pps": pps,
                       "splits": splits}

                def fn(c=c, splits=splits, tile_n=tile_n, warps=warps, stages=stages, layers=layers):
                    for kc, vc in layers:
                        tk.decode_attention(c.q, kc, vc, c.meta.block_tables, c.meta.seq_lens, d**-0.5, splits,
                                            tile_n=tile_n, num_warps=warps, num_stages=stages)
                try:
                    us = graph_us(fn) / len(layers)
                    row.update(graph_us_per_layer=us, kv_GBps=kv_bytes / us / 1e3)
                except Exception as e:  # noqa: BLE001 - a config that fails is a sweep result
                    row["error"] = str(e)[:200]
                rows.append(row)
        ok = [r for r in rows if "graph_us_per_layer" in r]
        best = min(ok, key=lambda r: r["graph_us_per_layer"])
        best_by_batch[batch] = (best["tile_n"], best["warps"], best["stages"], best["pps"])

        def one(c=c, best=best):
            tk.decode_attention(c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.seq_lens, d**-0.5,
                                best["splits"], tile_n=best["tile_n"], num_warps=best["warps"],
                                num_stages=best["stages"])
        best["do_bench_us_one_layer"] = bench_us(one)
        res["decode"] += rows
        res[f"decode_b{batch}_kv{kv}_best"] = best
        del c, layers
    res["decode_b8_kv2048_best_us"] = res["decode_b8_kv2048_best"]["do_bench_us_one_layer"]
    res["decode_b8_kv2048_best_graph_us"] = res["decode_b8_kv2048_best"]["graph_us_per_layer"]
    res["decode_b8_kv2048_flashinfer_us"] = FLASHINFER_H200["decode_b8_kv2048_us"]
    decode_table = [(4, *best_by_batch[1]), (24, *best_by_batch[8]), (128, *best_by_batch[64]),
                    (1 << 30, *best_by_batch[256])]
    res["decode_configs"] = decode_table

    # ---- prefill: the Triton configs (short: FlashInfer's shape; long: P3's and long-context chunks)
    res.update(prefill_attention_comparison(sweep=True))
    # apply the winners to the backend for the engine sections of this run
    tb.DECODE_CONFIGS = decode_table
    return res


# Prefill attention shapes: FlashInfer's (B=8, q 512 of kv 2048), P3's (one fresh 8192-token prompt) and
# 8192-token chunks of 32k / 64k / 128k-token prompts (what chunked prefill at budget 8192 runs).
PREFILL_SHAPES: dict[str, tuple[list[int], list[int]]] = {
    "b8_q512_kv2048": ([512] * 8, [2048] * 8),
    "1x8192": ([8192], [8192]),
    "c8192@32k": ([8192], [32768]),
    "c8192@64k": ([8192], [65536]),
    "c8192@128k": ([8192], [131072]),
}
PREFILL_SWEEP = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3)]


def _time_ms(fn, target_s: float = 0.25, max_iters: int = 20) -> float:
    """Median ms per call (CUDA events), after a warm-up call that also sizes the repetitions."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    iters = max(3, min(max_iters, int(target_s / max(time.perf_counter() - t, 1e-6))))
    return time_cuda(fn, warmup=0, iters=iters) * 1e3


def _time_ms_queue(fn, target_s: float = 0.25, max_iters: int = 40) -> float:
    """Mean ms per call over calls issued back to back between two events, after a warm-up: what the GPU
    spends when the host keeps ahead of it, as it does for an engine step's 32 layers. _time_ms syncs around
    each call, so a path's host time before its first kernel (Python, dispatch, library plan lookup) shows up
    as idle GPU time there."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    iters = max(3, min(max_iters, int(target_s / max(time.perf_counter() - t, 1e-6))))
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def prefill_attention_comparison(sweep: bool = False) -> dict[str, Any]:
    """Our prefill attention on the paged pool, as the engine calls it (backend.forward: `triton`, and
    `triton-cudnn` = long chunks' bulk on cuDNN over gathered K/V, finished by Triton), against the best
    library kernels on contiguous K/V for the same shapes in the same run: torch SDPA's cuDNN and flash
    backends (one call; lower-right causal for chunks, which only flash takes) and, for chunks, cuDNN on the
    two pieces a chunk splits into (context without mask + own keys causal, no merge: a bound)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from pdserve.attention import long_prefill as lp
    from pdserve.attention import triton_backend as tb
    from pdserve.attention import triton_kernels as tk
    from pdserve.testing.gpu_correctness import SdpaReference, make_paged_case, rel_err

    h, kvh, d = 32, 8, 128
    scale = d**-0.5
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"prefill": rows}
    cudnn_ok = lp.cudnn_usable(torch.device("cuda"))
    out["cudnn_usable"] = cudnn_ok
    backends = {"triton": tb.TritonAttention()}
    if cudnn_ok:
        backends["triton-cudnn"] = tb.TritonAttention(long_prefill=lp.LongPrefillConfig())
    fi, out["flashinfer"] = flashinfer_backend_or_reason()
    if fi is not None:
        backends["flashinfer"] = fi
    # correctness of the long path at sizes where the float32 reference is cheap. "several": a chunk with
    # bulk and own keys, a chunk with a ragged context, a short prompt and a decode row in one step (partials
    # copied into step-wide buffers); "one": one long chunk beside a decode row (partials read in place);
    # "fresh": one whole fresh prompt (one causal library call)
    checks = {"several": ([2048, 2500, 100, 1], [2048 + 8192, 2500 + 9000, 100, 700]),
              "one": ([3000, 1], [3000 + 8192 + 50, 900]), "fresh": ([4096], [4096])}
    out["correctness"] = {}
    for label, (ql, sl) in checks.items():
        c = make_paged_case(ql, sl, h, kvh, d, seed=11)
        want = SdpaReference(torch.float32).forward(c.q, c.k_cache, c.v_cache, c.meta, scale).float()
        for name, be in backends.items():
            out["correctness"][f"{label}/{name}"] = rel_err(be.forward(c.q, c.k_cache, c.v_cache, c.meta, scale),
                                                            want)
        del c, want
    if fi is not None:
        out["correctness_flashinfer"] = flashinfer_kernel_cases(fi, backends["triton"])
    out["correctness_ok"] = all(v < 2e-2 for v in out["correctness"].values()) and all(
        r["ok"] for r in out.get("correctness_flashinfer", []))
    best_cfg: dict[str, tuple[float, tuple]] = {}
    for name, (q_lens, s_lens) in PREFILL_SHAPES.items():
        flops = sum(lp.causal_chunk_flops(h, d, q, s) for q, s in zip(q_lens, s_lens, strict=True))
        c = make_paged_case(q_lens, s_lens, h, kvh, d, num_layers=8, seed=3)
        m = c.meta

        queued: dict[str, float] = {}  # key -> TFLOP/s timed back to back (see _time_ms_queue)

        def add(kind: str, fn, row_extra: dict | None = None, name=name, flops=flops,
                key: str | None = None, queued=queued) -> float | None:
            row = {"shape": name, "kind": kind, **(row_extra or {})}
            try:
                ms = _time_ms(fn)
                row.update(ms=ms, tflops=flops / ms / 1e9)
                if key is not None:
                    mq = _time_ms_queue(fn)
                    row.update(ms_queue=mq, tflops_queue=flops / mq / 1e9)
                    queued[key] = row["tflops_queue"]
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"  {name:15s} {kind:38s} {row.get('tflops', 0):6.1f} TFLOP/s (back to back "
                  f"{row.get('tflops_queue', 0):6.1f}) {row.get('error', '')[:80]}", flush=True)
            return row.get("tflops")

        if sweep:
            group = "short" if max(q_lens) < tb.PREFILL_LONG_FROM_Q else "long"
            for cfg in PREFILL_SWEEP:
                tf = add("triton " + "/".join(map(str, cfg)), lambda c=c, m=m, cfg=cfg: tk.prefill_attention(
                    c.q, c.k_cache, c.v_cache, m.block_tables, m.seq_lens, m.query_start_loc, scale,
                    len(m.seq_lens_host), block_m=cfg[0], tile_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3]))
                if tf:
                    prev = best_cfg.get(group + str(cfg), (1.0, cfg))
                    best_cfg[group + str(cfg)] = (prev[0] * tf, cfg)  # product over the group's shapes
        ours = {bn: add(f"ours: backend {bn}", lambda c=c, m=m, be=be: be.forward(c.q, c.k_cache, c.v_cache, m,
                                                                                    scale), key=bn)
                for bn, be in backends.items() if bn != "flashinfer"}
        lib: dict[str, float | None] = {}
        if fi is not None:
            # the plan is made once per step (every layer reuses it): timed apart, the kernel as layers see it
            lib["flashinfer_paged"] = add("FlashInfer: same paged pool, backend.forward",
                                          lambda c=c, m=m: fi.forward(c.q, c.k_cache, c.v_cache, m, scale),
                                          key="flashinfer_paged")
            out[f"{name}_flashinfer_plan_ms"] = _flashinfer_plan_ms(fi, c, scale)
            out[f"{name}_flashinfer_backend"] = getattr(fi.prefill, "_backend", None)
        del c
        b, L, S = len(q_lens), q_lens[0], s_lens[0]
        q4 = torch.randn((b, h, L, d), device="cuda", dtype=torch.bfloat16)
        k4 = torch.randn((b, kvh, S, d), device="cuda", dtype=torch.bfloat16)
        v4 = torch.randn((b, kvh, S, d), device="cuda", dtype=torch.bfloat16)
        mask = None if L == S else causal_lower_right(L, S)
        for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            if mask is not None and be == SDPBackend.CUDNN_ATTENTION:
                continue  # torch's cuDNN entry point has no lower-right causal mask

            def sdpa(be=be, q4=q4, k4=k4, v4=v4, mask=mask):
                with sdpa_kernel([be]):
                    if mask is None:
                        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
                    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
            lib[be.name.lower()] = add(f"library: sdpa {be.name.lower()}, contiguous", sdpa, key=be.name.lower())
        if mask is not None and cudnn_ok:
            ctx = S - L

            def split(q4=q4, k4=k4, v4=v4, ctx=ctx, b=b):
                for i in range(b):
                    qh, kh, vh = q4[i : i + 1], k4[i : i + 1], v4[i : i + 1]
                    torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh[:, :, :ctx], vh[:, :, :ctx], None,
                                                                       True, 0.0, False, False, scale=scale)
                    torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh[:, :, ctx:], vh[:, :, ctx:], None,
                                                                       True, 0.0, True, False, scale=scale)
            lib["cudnn_split"] = add("library: cudnn ctx + own causal, contiguous, no merge", split,
                                     key="cudnn_split")
        best_lib = max((v for v in lib.values() if v), default=None)
        best_torch = max((v for k, v in lib.items() if v and k != "flashinfer_paged"), default=None)
        best_ours = max((v for v in ours.values() if v), default=None)
        out[f"{name}_ours_tflops"] = ours
        out[f"{name}_library_tflops"] = lib
        out[f"{name}_best_library_tflops"] = best_lib
        if best_lib and best_ours:
            out[f"{name}_ours_vs_best_library"] = best_ours / best_lib
        if best_torch and best_ours:
            out[f"{name}_ours_vs_best_torch_library"] = best_ours / best_torch
        if lib.get("flashinfer_paged") and ours.get("triton"):
            out[f"{name}_triton_vs_flashinfer"] = ours["triton"] / lib["flashinfer_paged"]
        out[f"{name}_back_to_back_tflops"] = queued
        best_ours_q = max((queued.get(k, 0.0) for k in ours), default=0.0)
        best_lib_q = max((queued.get(k, 0.0) for k in lib), default=0.0)
        if best_ours_q and best_lib_q:
            out[f"{name}_ours_vs_best_library_back_to_back"] = best_ours_q / best_lib_q
        del q4, k4, v4
        torch.cuda.empty_cache()
    if sweep and best_cfg:
        for group in ("short", "long"):
            cands = [v for k, v in best_cfg.items() if k.startswith(group)]
            if cands:
                win = max(cands)[1]
                out[f"prefill_best_config_{group}"] = win
                setattr(tb, f"PREFILL_CONFIG_{group.upper()}", tuple(win))
    return out


def flashinfer_backend_or_reason() -> tuple[Any, str]:
    """pdserve's FlashInfer backend when the package imports here (it is optional), else why not."""
    try:
        from pdserve.attention.flashinfer_backend import FlashInferAttention

        fi = FlashInferAttention(torch.device("cuda"))
        fi.min_layer_flops = 0  # the kernel on every shape it can take, however small (the engine sets a bar)
        import flashinfer

        return fi, f"flashinfer {flashinfer.__version__}"
    except Exception as e:  # noqa: BLE001 - not carried or not importable: the comparison says so
        return None, f"not available: {type(e).__name__}: {str(e)[:300]}"


def flashinfer_kernel_cases(fi, triton_be) -> list[dict[str, Any]]:
    """FlashInfer's backend.forward vs float32 SDPA and vs our Triton prefill on the kernel cases the Triton
    kernels are checked on (mixed decode rows, prefixes, GQA 7; head dim 128 only), plus a step of ragged
    last pages with two runs over TRITON_MAX_Q (flashinfer_path: whether the step took FlashInfer's kernel)."""
    from pdserve.testing.gpu_correctness import KERNEL_CASES, SdpaReference, make_paged_case, rel_err

    # head dim 128 only: another head dim is another JIT build (~1 min on a fresh machine)
    cases = [c for c in KERNEL_CASES if not all(q == 1 for q in c["q"]) and c["d"] == 128]
    cases.append({"name": "flashinfer-path-ragged", "q": [65, 300, 1, 129], "s": [65, 1000, 77, 4000],
                  "h": 32, "kvh": 8, "d": 128})
    ref = SdpaReference(torch.float32)
    rows = []
    for n, case in enumerate(cases):
        c = make_paged_case(case["q"], case["s"], case["h"], case["kvh"], case["d"], seed=200 + n)
        scale = case["d"] ** -0.5
        want = ref.forward(c.q, c.k_cache, c.v_cache, c.meta, scale).float()
        row: dict[str, Any] = {"case": case["name"], "flashinfer_path": max(case["q"]) > 64}
        try:
            got = fi.forward(c.q, c.k_cache, c.v_cache, c.meta, scale)
            row["rel_err_vs_fp32"] = rel_err(got, want)
            row["rel_err_vs_triton"] = rel_err(got, triton_be.forward(c.q, c.k_cache, c.v_cache, c.meta, scale))
            row["ok"] = row["rel_err_vs_fp32"] < 2e-2
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}", ok=False)
        rows.append(row)
        print(f"  flashinfer correctness {row}", flush=True)
    return rows


def _flashinfer_plan_ms(fi, c, scale: float, reps: int = 5) -> float:
    """Host time of FlashInfer's per-step plan (page table, schedule), made once per step."""
    times = []
    for _ in range(reps):
        fi._planned = None
        torch.cuda.synchronize()
        t = time.perf_counter()
        fi._plan(c.meta, c.q, c.k_cache, scale)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def fresh_prompt_breakdown() -> dict[str, Any]:
    """Why `triton-cudnn` reached 89 % of cuDNN on one fresh 8192-token prompt (issue 21's goal 90 %): the
    path (`long_prefill.attend_fresh_prompt`: gather K and V out of the pool, one causal cuDNN call on
    [L, H, D]-strided tensors) against its parts, in one run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pdserve.attention import long_prefill as lp
    from pdserve.testing.gpu_correctness import make_paged_case

    h, kvh, d, n = 32, 8, 128, 8192
    scale = d**-0.5
    flops = lp.causal_chunk_flops(h, d, n, n)
    c = make_paged_case([n], [n], h, kvh, d, num_layers=8, seed=3)
    m = c.meta
    k = lp.gather_kv(c.k_cache, m.block_tables[0], n)
    v = lp.gather_kv(c.v_cache, m.block_tables[0], n)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (c.q, k, v))  # [1, H, L, D] contiguous
    variants = {
        "path: gather + cuDNN causal (attend_fresh_prompt)": lambda: lp.attend_fresh_prompt(
            c.q, c.k_cache, c.v_cache, m, scale),
        "gather K and V only": lambda: (lp.gather_kv(c.k_cache, m.block_tables[0], n),
                                        lp.gather_kv(c.v_cache, m.block_tables[0], n)),
        "cuDNN causal on gathered [L, H, D] (no gather)": lambda: lp._attend_cudnn(c.q, k, v, True, scale, False),
        "cuDNN causal, aten op, contiguous [1, H, L, D]": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q4, k4, v4, None, False, 0.0, True, False, scale=scale),
        "cuDNN causal, q [L, H, D] + K/V contiguous [1, KVH, S, D]":
            lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                lp._heads_first(c.q), k4, v4, None, False, 0.0, True, False, scale=scale),
        "gather K and V into [KVH, S, D] (gather + transposing copy)": lambda: tuple(
            lp.gather_kv(x, m.block_tables[0], n).transpose(0, 1).contiguous() for x in (c.k_cache, c.v_cache)),
    }

    def sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    variants["sdpa cuDNN, contiguous [1, H, L, D] (the suite's best library)"] = sdpa
    out: dict[str, Any] = {}
    for label, fn in variants.items():
        ms = _time_ms(fn, target_s=0.4, max_iters=40)
        mq = _time_ms_queue(fn, target_s=0.4)
        out[label] = {"ms": ms, "tflops": flops / ms / 1e9, "ms_back_to_back": mq, "tflops_back_to_back": flops / mq / 1e9}
        print(f"  {label:70s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s; back to back {mq:7.3f} ms", flush=True)
    return out


def decode_flashinfer_vs_triton() -> dict[str, Any]:
    """Paged decode over the same pool views: FlashInfer's BatchDecodeWithPagedKVCacheWrapper ((k, v) tuple of
    strided views, planned once) against our Triton split-KV decode as the backend runs it; one layer,
    triton's do_bench (median), same method for both."""
    import flashinfer  # optional: without it the section fails and says why

    from pdserve.attention import triton_backend as tb
    from pdserve.testing.gpu_correctness import SdpaReference, make_paged_case, rel_err

    h, kvh, d = 32, 8, 128
    scale = d**-0.5
    ours = tb.TritonAttention()
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {}
    for batch, kv in ((8, 2048), (64, 2048)):
        c = make_paged_case([1] * batch, [kv] * batch, h, kvh, d, num_layers=8, seed=batch)
        m = c.meta
        pages = (kv + 15) // 16
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device="cuda"),
                     m.block_tables[:, :pages].reshape(-1).to(torch.int32),
                     torch.full((batch,), kv - (pages - 1) * 16, dtype=torch.int32, device="cuda"),
                     h, kvh, d, 16, q_data_type=c.q.dtype, kv_data_type=c.q.dtype, sm_scale=scale)
        want = SdpaReference(torch.float32).forward(c.q, c.k_cache, c.v_cache, m, scale).float()
        kv_bytes = batch * kv * kvh * d * 2 * 2
        res: dict[str, Any] = {}
        layers = [(c.pool[:, i, 0], c.pool[:, i, 1]) for i in range(c.pool.shape[1])]
        for label, fn, all_layers in (
                ("triton", lambda c=c, m=m: ours.forward(c.q, c.k_cache, c.v_cache, m, scale),
                 lambda c=c, m=m, layers=layers: [ours.forward(c.q, k, v, m, scale) for k, v in layers]),
                ("flashinfer", lambda c=c, w=wrapper: w.run(c.q, (c.k_cache, c.v_cache)),
                 lambda c=c, w=wrapper, layers=layers: [w.run(c.q, kv) for kv in layers])):
            us = bench_us(fn)
            res[label] = {"us": us, "kv_GBps": kv_bytes / us / 1e3, "rel_err_vs_fp32": rel_err(fn(), want)}
            try:  # the engine's decode runs in CUDA graphs: device time alone, over the pool's layers
                g = graph_us(all_layers) / len(layers)
                res[label].update(graph_us_per_layer=g, graph_kv_GBps=kv_bytes / g / 1e3)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot be captured is a result
                res[label]["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[f"b{batch}_kv{kv}"] = res
        print(f"  decode b{batch} kv{kv}: {res}", flush=True)
        del c
    return out


# ---------------------------------------------------------------------------------------------------
# engine benchmarks
# ---------------------------------------------------------------------------------------------------
class EngineBench:
    def __init__(self, max_model_len: int = 131072, max_num_seqs: int = 256, kv_cache_dtype: str = "auto",
                 attention_backend: str = "auto"):
        from pdserve.engine.engine import LLMEngine
        from pdserve.model.packaged_configs import dummy_model_dir
        from pdserve.types.engine_config import EngineConfig

        self.model_name = "Llama-3.1-8B"
        t0 = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(
            model=str(dummy_model_dir(self.model_name)), load_format="dummy", dtype="bfloat16",
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
            gpu_memory_utilization=0.9,  # prefix caching on, as served (random prompts never hit)
            kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend,
        ))
        torch.cuda.synchronize()
        self.init_s = time.perf_counter() - t0
        runner = self.engine.runner
        # the engine's warm-up built the library plans for long chunks (LLMEngine._warm_up); a second call
        # finds them cached: its time says whether they were
        t1 = time.perf_counter()
        c = runner.model_cfg
        warm = getattr(runner.backend, "warm_up", None)
        self.library_plans = warm(c.num_heads, c.num_kv_heads, c.head_dim, runner.dtype, runner.device, 8192,
                                  max_model_len) if warm else 0
        self.library_warm_up_s = time.perf_counter() - t1
        self.cfg = runner.model_cfg
        model = runner.model
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.embed_tokens.weight
        # a decode step reads every weight once, except the embedding table (one row per token)
        self.weight_bytes_per_step = self.param_bytes - embed.numel() * embed.element_size()
        c = self.cfg
        self.kv_bytes_per_token = runner.block_bytes // runner.block_size  # every layer's K and V (+ fp8 scales)
        layer = model.layers[0]
        per_layer = sum(m.weight.numel() for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj))
        self.linear_params = per_layer * c.num_layers
        free, total = torch.cuda.mem_get_info()
        self.info = {
            "model": self.model_name, "init_s": round(self.init_s, 1), "library_plans": self.library_plans,
            "library_warm_up_s": round(self.library_warm_up_s, 2), "attention_backend": runner.backend.name,
            "attention_long_prefill":
                str(getattr(runner.backend, "long_prefill", None)), "param_GB": self.param_bytes / 1e9,
            "weight_bytes_per_decode_step_GB": self.weight_bytes_per_step / 1e9,
            "num_blocks": runner.num_blocks, "kv_pool_GB": runner.kv_pool.numel() * runner.kv_pool.element_size() / 1e9,
            "kv_cache_dtype": runner.kv_cache_dtype, "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_tokens": runner.num_blocks * runner.block_size,
            "graph_sizes": runner.gpu.graph_sizes, "gpu_free_after_init_GB": free / 1e9,
            "gpu_total_GB": total / 1e9, "max_allocated_GB": torch.cuda.max_memory_allocated() / 1e9,
        }
        self.counter = 0
        self.gen = torch.Generator().manual_seed(1234)
        self.p1_steps = 400
        self.warmed_modes: set[str] = set()  # long_context's attention modes that have run once

    def prompts(self, n: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.cfg.vocab_size, (n, length), generator=self.gen).tolist()

    def add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from pdserve.types.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = []
        for p in prompts:
            rid = f"b{self.counter}"
            self.counter += 1
            self.engine.add_request(rid, p, params)
            ids.append(rid)
        return ids

    def drain(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        while self.engine.has_unfinished():
            self.engine.step()

    def decode(self, batch: int, prompt_len: int, steps: int, profile: bool = True) -> dict[str, Any]:
        eng = self.engine
        ids = self.add(self.prompts(batch, prompt_len), steps + 40)
        prefill_steps = []
        while any(not eng.requests[r].output_token_ids for r in ids):
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            prefill_steps.append(time.perf_counter() - t)
        for _ in range(3):  # settle
            eng.step()
        runner_timing = eng.runner.step_timing
        runner_timing.reset()
        times = []
        ctx = []
        for _ in range(steps):
            ctx.append(sum(eng.requests[r].num_tokens for r in ids))  # keys read by this step's attention
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        assert runner_timing.graph_steps == steps, "decode steps did not replay graphs"
        # the same step on the device alone: replay the last captured graph in a loop
        gpu = eng.runner.gpu
        size = min(s for s in gpu.graph_sizes if s >= batch)
        graph = gpu.graphs[size][0]
        dev_s = time_cuda(graph.replay, warmup=3, iters=20)
        breakdown = self.kernel_breakdown(size) if profile else None
        replay_profile = self.graph_profile(size) if batch == 1 and profile else None
        self.drain()
        itl = statistics.median(times)
        kv_bytes = statistics.median(ctx) * self.kv_bytes_per_token
        step_bytes = self.weight_bytes_per_step + kv_bytes
        return {
            "batch": batch, "prompt_len": prompt_len, "steps": steps, "itl_ms": itl * 1e3,
            "itl_p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3, "device_only_step_ms": dev_s * 1e3,
            "weight_GB": self.weight_bytes_per_step / 1e9, "kv_read_GB": kv_bytes / 1e9,
            "bytes_per_step_GB": step_bytes / 1e9, "achieved_GBps": step_bytes / itl / 1e9,
            "achieved_GBps_device_only": step_bytes / dev_s / 1e9,
            "weight_only_GBps": self.weight_bytes_per_step / itl / 1e9,
            "cpu_share": 1 - runner_timing.wait_s / sum(times),
            # host time per step: inside the runner (inputs, launch) and outside it (scheduler, blocks, outputs)
            "runner_host_ms": (runner_timing.total_s - runner_timing.wait_s) / steps * 1e3,
            "runner_graph_launch_ms": runner_timing.launch_s / steps * 1e3,
            "engine_outside_runner_ms": (sum(times) - runner_timing.total_s) / steps * 1e3,
            "prefill_step_s": [round(x, 4) for x in prefill_steps],
            "kernel_breakdown": breakdown,
            "graph_replay_profile": replay_profile,
        }

    def kernel_breakdown(self, size: int) -> dict[str, Any]:
        """Device time per kernel kind in one decode step (the graph's body run eagerly under the profiler,
        so the per-kernel durations are real and the gaps between them are not counted)."""
        from torch.profiler import ProfilerActivity, profile

        gpu = self.engine.runner.gpu
        with torch.inference_mode():
            gpu._graph_forward(size)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    gpu._graph_forward(size)
                torch.cuda.synchronize()
        kinds: dict[str, float] = {}
        count: dict[str, int] = {}
        for ev in prof.key_averages():
            us = ev.device_time_total / 2  # per step
            if us <= 0:
                continue
            name = ev.key
            kinds[name] = kinds.get(name, 0.0) + us
            count[name] = count.get(name, 0) + ev.count // 2
        total = sum(kinds.values())
        top = sorted(kinds.items(), key=lambda kv: -kv[1])[:20]
        by_kind: dict[str, float] = {}
        for k, v in kinds.items():
            by_kind[_kernel_kind(k)] = by_kind.get(_kernel_kind(k), 0.0) + v
        return {"device_us_per_step": total, "kernels_per_step": sum(count.values()),
                "by_kind_us": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                "top": [{"kernel": k[:90], "us": round(v, 1), "calls": count[k]} for k, v in top]}

    def graph_profile(self, size: int, replays: int = 5) -> dict[str, Any]:
        """torch.profiler (CUPTI) over replays of the captured decode graph as the engine replays it: device
        time per kernel kind, and the gaps between consecutive kernels (the replay's span minus the kernels'
        busy time), per replay. The tracing itself may widen the gaps a little: compare span_us with the
        unprofiled replay time."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        graph = self.engine.runner.gpu.graphs[size][0]
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
                torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        if not evs or len(evs) % replays:
            return {"error": f"{len(evs)} device events for {replays} replays"}
        n = len(evs) // replays
        spans, busies, gap_sums = [], [], []
        gaps_by_pair: dict[str, float] = {}
        for r in range(replays):
            chunk = evs[r * n : (r + 1) * n]
            spans.append(chunk[-1].time_range.end - chunk[0].time_range.start)
            busies.append(sum(e.time_range.end - e.time_range.start for e in chunk))
            gaps = [max(0.0, b.time_range.start - a.time_range.end) for a, b in zip(chunk, chunk[1:], strict=False)]
            gap_sums.append(sum(gaps))
            for a, b, g in zip(chunk, chunk[1:], gaps, strict=False):
                key = f"{_kernel_kind(a.name)} -> {_kernel_kind(b.name)}"
                gaps_by_pair[key] = gaps_by_pair.get(key, 0.0) + g / replays
        kinds: dict[str, list[float]] = {}
        for e in evs:
            k = kinds.setdefault(_kernel_kind(e.name), [0.0, 0])
            k[0] += (e.time_range.end - e.time_range.start) / replays
            k[1] += 1
        return {
            "kernels_per_replay": n, "span_us": statistics.median(spans), "busy_us": statistics.median(busies),
            "gaps_us": statistics.median(gap_sums), "mean_gap_us": statistics.median(gap_sums) / max(n - 1, 1),
            "by_kind_us": {k: {"us": round(v[0], 1), "per_replay": v[1] // replays}
                           for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
            "gaps_by_kind_pair_us": {k: round(v, 1) for k, v in sorted(gaps_by_pair.items(), key=lambda kv: -kv[1])[:12]},
        }

    def p1_variant(self, epilogues: bool = True, norm_epilogue: bool = True, merge: bool = False,
                   rope_table: bool = True) -> dict[str, Any]:
        """P1 again in the same engine with issue 21's decode fusions switched as given (the batch-1 graph
        recaptured, then recaptured back): all off = separate RoPE + K/V store, SiLU-and-mul, add + RMSNorm,
        argmax kernels and RoPE cos/sin computed per step (PDSERVE_DECODE_FUSIONS=0; on by default); merge =
        the split merge inside the decode kernel (off by default). Before/after in one run."""
        from pdserve.engine.runner import gemv

        backend = self.engine.runner.backend
        model = self.engine.runner.model
        saved = gemv.EPILOGUE_FUSIONS, gemv.NORM_EPILOGUE, backend.fused_decode_merge, model.rope_table_len
        gemv.EPILOGUE_FUSIONS = epilogues
        gemv.NORM_EPILOGUE = norm_epilogue
        backend.fused_decode_merge = merge
        model.rope_table_len = saved[3] if rope_table else None
        try:
            self._recapture(1)
            out = self.decode(1, 128, self.p1_steps)
            out["fusions"] = {"epilogues": epilogues, "norm_epilogue": norm_epilogue, "merge": merge,
                              "rope_table": rope_table}
            return out
        finally:
            gemv.EPILOGUE_FUSIONS, gemv.NORM_EPILOGUE, backend.fused_decode_merge, model.rope_table_len = saved
            self._recapture(1)

    def decode_async(self, on: bool, batch: int = 1, prompt_len: int = 128, steps: int | None = None,
                     ) -> dict[str, Any]:
        """A decode run with async scheduling on (decode steps launched before the previous step's tokens are
        read: pdserve.engine.runner.async_decode) or off (every step waits for its tokens), in the same engine: the
        pipeline swapped in or out between runs. Before/after in one run."""
        from pdserve.engine.runner.async_decode import DecodePipeline

        eng = self.engine
        self.drain()
        saved = eng.pipeline
        eng.pipeline = DecodePipeline(eng.scheduler, eng.blocks, eng.runner) if on else None
        try:
            ahead0 = eng.pipeline.num_launched_ahead if on else 0
            out = self.decode(batch, prompt_len, steps or self.p1_steps, profile=False)
            out["async_scheduling"] = on
            out["launched_ahead"] = (eng.pipeline.num_launched_ahead - ahead0) if on else 0
            return out
        finally:
            self.drain()
            eng.pipeline = saved

    def long_context_chunking(self, prompt_len: int, settings: tuple[tuple[int, int], ...],
                              reps: int = 2) -> dict[str, Any]:
        """TTFT of one prompt (max_tokens 1), the default attention mode, same engine, under several chunkings:
        (max_num_batched_tokens, prefill_only_chunk_tokens) of the scheduler; each setting first runs the
        prompt length once untimed (its chunk shapes' kernels and library plans)."""
        eng = self.engine
        c = self.cfg
        flops = (2.0 * self.linear_params * prompt_len
                 + c.num_layers * _attention_flops(c.num_heads, c.head_dim, [prompt_len], [prompt_len])
                 + 2.0 * c.vocab_size * c.hidden_size)
        out: dict[str, Any] = {"prompt_len": prompt_len, "flops_T": flops / 1e12, "settings": {}}
        sch = eng.scheduler
        saved = sch.max_num_batched_tokens, sch.prefill_only_chunk_tokens
        try:
            for budget, chunk in settings:
                sch.max_num_batched_tokens, sch.prefill_only_chunk_tokens = budget, chunk
                times, step_ms = [], []
                for rep in range(reps + 1):
                    self.add(self.prompts(1, prompt_len), 1)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    steps = []
                    while eng.has_unfinished():
                        ts = time.perf_counter()
                        eng.step()
                        steps.append(time.perf_counter() - ts)
                    if rep:  # the first is the untimed warm-up
                        times.append(time.perf_counter() - t)
                        step_ms = [round(x * 1e3, 1) for x in steps]
                ttft = statistics.median(times)
                out["settings"][f"budget {budget}, prefill-only chunk {chunk}"] = {
                    "ttft_s": ttft, "all_s": [round(x, 4) for x in times], "step_ms": step_ms,
                    "tflops": flops / ttft / 1e12}
        finally:
            sch.max_num_batched_tokens, sch.prefill_only_chunk_tokens = saved
        return out

    def gemv_epilogue_costs(self) -> dict[str, Any]:
        """Graph-timed us of each batch-1 GEMV of layer 0 (and the LM head) plain vs with its epilogue
        (issue 21): what the epilogue adds to the kernel it rides on."""
        from pdserve.engine.runner import gemv as gv

        model = self.engine.runner.model
        layer = model.layers[0]
        dev = model.lm_head.weight.device
        dt = model.lm_head.weight.dtype
        scratch = gv.new_epilogue_scratch(dev)
        hidden = model.cfg.hidden_size
        x_h = torch.randn((1, hidden), device=dev, dtype=dt)
        x_i = torch.randn((1, layer.mlp.intermediate), device=dev, dtype=dt)
        x_o = torch.randn((1, layer.self_attn.q_size), device=dev, dtype=dt)
        res = torch.randn((1, hidden), device=dev, dtype=dt)
        nw = layer.post_attention_layernorm.weight
        out: dict[str, Any] = {}
        cases = {
            "gate_up": (lambda: gv.gemv(x_h, layer.mlp.gate_up_proj.weight),
                        lambda: gv.gate_up_silu(x_h, layer.mlp.gate_up_proj)),
            "o_proj": (lambda: gv.gemv(x_o, layer.self_attn.o_proj.weight),
                       lambda: gv.linear_add_rms_norm(x_o, layer.self_attn.o_proj, res, nw, 1e-5, scratch[2:3])),
            "down": (lambda: gv.gemv(x_i, layer.mlp.down_proj.weight),
                     lambda: gv.linear_add_rms_norm(x_i, layer.mlp.down_proj, res, nw, 1e-5, scratch[2:3])),
            "lm_head": (lambda: gv.gemv(x_h, model.lm_head.weight),
                        lambda: gv.lm_head_argmax(x_h, model.lm_head, scratch[0:2])),
        }
        with torch.inference_mode():
            for name, (plain, fused) in cases.items():
                out[name] = {"plain_us": graph_us(plain), "epilogue_us": graph_us(fused)}
        return out

    def _recapture(self, size: int) -> None:
        gpu = self.engine.runner.gpu
        with torch.inference_mode():
            gpu._graph_forward(size)  # compiles what the capture needs
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                logits, tokens = gpu._graph_forward(size)
        gpu.graphs[size] = (g, logits, tokens)

    def decode_no_prefix_cache(self, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
        """The same decode with the block manager's prefix caching off: how much of the engine's per-step
        host time is its per-step walk over every full block (cache_full_blocks)."""
        blocks = self.engine.blocks
        blocks.enable_prefix_caching = False
        try:
            return self.decode(batch, prompt_len, steps)
        finally:
            blocks.enable_prefix_caching = True

    def host_profile(self, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
        """cProfile of decode steps at a large batch: where the host time of a step goes."""
        import cProfile
        import io
        import pstats

        eng = self.engine
        ids = self.add(self.prompts(batch, prompt_len), steps + 40)
        while any(not eng.requests[r].output_token_ids for r in ids):
            eng.step()
        timing = eng.runner.step_timing
        timing.reset()
        plain = []
        for _ in range(10):
            t = time.perf_counter()
            eng.step()
            plain.append(time.perf_counter() - t)
        split = {
            "runner_host_ms": (timing.total_s - timing.wait_s) / 10 * 1e3,
            "runner_graph_launch_ms": timing.launch_s / 10 * 1e3,
            "runner_wait_ms": timing.wait_s / 10 * 1e3,
            "engine_outside_runner_ms": (sum(plain) - timing.total_s) / 10 * 1e3,
            "graph_steps": timing.graph_steps,
        }
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            eng.step()
        prof.disable()
        self.drain()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        return {"batch": batch, "prompt_len": prompt_len, "unprofiled_step_ms": statistics.median(plain) * 1e3,
                "unprofiled_split": split,
                "profiled_steps": steps, "top_tottime": text.getvalue()[-6000:]}

    def decode_variants_b1(self) -> dict[str, Any]:
        """Batch 1 on the device: fused ops + graph (production), the same eagerly, and torch ops + graph.
        Measures what the fused kernels and the graphs each buy."""
        eng = self.engine
        gpu = eng.runner.gpu
        model = eng.runner.model
        ids = self.add(self.prompts(1, 128), 200)
        while not eng.requests[ids[0]].output_token_ids:
            eng.step()
        eng.step()  # the static buffers now hold a real decode step's inputs
        out: dict[str, Any] = {}
        with torch.inference_mode():
            out["fused_graph_ms"] = time_cuda(gpu.graphs[1][0].replay, iters=20) * 1e3
            out["fused_eager_ms"] = time_cuda(lambda: gpu._graph_forward(1), iters=20) * 1e3
            ops = model.fused_ops
            linear = ops.linear
            ops.linear = lambda x, layer: layer(x)  # the fused path with cuBLAS GEMVs
            from pdserve.engine.runner import gemv

            gemv.EPILOGUE_FUSIONS = False  # (the epilogue GEMVs are Triton's)
            try:
                gpu._graph_forward(1)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    gpu._graph_forward(1)
                out["fused_graph_cublas_linears_ms"] = time_cuda(g.replay, iters=20) * 1e3
                del g
            finally:
                ops.linear = linear
                gemv.EPILOGUE_FUSIONS = True
            model.fused_ops = None
            try:
                gpu._graph_forward(1)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    gpu._graph_forward(1)
                out["torch_ops_graph_ms"] = time_cuda(g.replay, iters=20) * 1e3
                del g
            finally:
                model.fused_ops = ops
        self.drain()
        return out

    def prefill(self, n_seqs: int, seq_len: int, reps: int = 3) -> dict[str, Any]:
        eng = self.engine
        times = []
        for _ in range(reps):
            self.add(self.prompts(n_seqs, seq_len), 1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
            assert not eng.has_unfinished(), "the prompts did not fit one step"
        c = self.cfg
        tokens = n_seqs * seq_len
        flops_linear = 2.0 * self.linear_params * tokens
        flops_attn = c.num_layers * _attention_flops(c.num_heads, c.head_dim, [seq_len] * n_seqs, [seq_len] * n_seqs)
        flops_head = 2.0 * n_seqs * c.vocab_size * c.hidden_size
        flops = flops_linear + flops_attn + flops_head
        t = statistics.median(times)
        return {"n_seqs": n_seqs, "seq_len": seq_len, "step_s": t, "all_s": times, "tflops": flops / t / 1e12,
                "flops_T": flops / 1e12, "attention_flop_share": flops_attn / flops}

    def prefill_profile(self, seq_len: int = 8192) -> dict[str, Any]:
        """Where one prompt's prefill step goes (issue 36: P3 at 77.9 % of matmul): one unprofiled step for the
        wall time, then one under torch.profiler (CUDA and CPU): device busy time per kernel kind, the device's
        idle time inside the step (the span minus the busy time: host-bound stretches) and the time from the
        step's start to its first kernel and from its last kernel to the step's end."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        eng = self.engine
        wall = self.prefill(1, seq_len, reps=2)
        self.add(self.prompts(1, seq_len), 1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            step_us = (time.perf_counter() - t0) * 1e6
        evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > 0),
                     key=lambda e: e.time_range.start)
        if not evs:
            return {"error": "no device events"}
        span = evs[-1].time_range.end - evs[0].time_range.start
        busy, end = 0.0, evs[0].time_range.start
        for e in evs:  # union of the kernels' intervals (streams may overlap)
            start = max(e.time_range.start, end)
            if e.time_range.end > start:
                busy += e.time_range.end - start
                end = e.time_range.end
        kinds: dict[str, float] = {}
        for e in evs:
            kinds[_kernel_kind(e.name)] = kinds.get(_kernel_kind(e.name), 0.0) + e.time_range.end - e.time_range.start
        host = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        return {
            "wall": wall, "profiled_step_us": step_us, "kernels": len(evs), "device_span_us": span,
            "device_busy_us": busy, "device_idle_in_span_us": span - busy,
            "before_first_kernel_us": (evs[0].time_range.start - min((e.time_range.start for e in host),
                                                                      default=evs[0].time_range.start)),
            "by_kind_us": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:16]},
        }

    def attention_modes(self, with_default: bool = True) -> dict[str, tuple[Any, bool]]:
        """The prefill paths one engine can switch between: name -> (long_prefill config, FlashInfer on).
        `triton`: the Triton kernel alone; `triton-cudnn`: long chunks' bulk on cuDNN; with an engine built
        with `--attention-backend flashinfer` also `flashinfer-only` (every prefill step on FlashInfer) and
        `flashinfer` (that backend as served: FlashInfer for steps above its FLOPs bar without long chunks,
        triton-cudnn for those; the same code as triton-cudnn for prompts of full 8192-token chunks, so
        with_default False leaves it out)."""
        from pdserve.attention import long_prefill as lp

        cudnn = lp.LongPrefillConfig() if lp.cudnn_usable(torch.device("cuda")) else None
        modes: dict[str, tuple[Any, bool]] = {"triton": (None, False)}
        if cudnn is not None:
            modes["triton-cudnn"] = (cudnn, False)
        if getattr(self.engine.runner.backend, "flashinfer_prefill", None) is not None:
            modes["flashinfer-only"] = (None, True)
            if with_default:
                modes["flashinfer"] = (cudnn, True)
        return modes

    @contextlib.contextmanager
    def attention_mode(self, long_prefill_cfg: Any, flashinfer_on: bool):
        """FlashInfer on without long_prefill: every prefill step it can take, small ones too (no FLOPs bar)."""
        backend = self.engine.runner.backend
        saved = getattr(backend, "long_prefill", None)
        saved_fi = getattr(backend, "flashinfer_prefill", None)
        saved_bar = getattr(backend, "min_layer_flops", None)
        backend.long_prefill = long_prefill_cfg
        if saved_fi is not None:
            backend.flashinfer_prefill = flashinfer_on
            backend.min_layer_flops = saved_bar if long_prefill_cfg is not None else 0
        try:
            yield
        finally:
            backend.long_prefill = saved
            if saved_fi is not None:
                backend.flashinfer_prefill = saved_fi
                backend.min_layer_flops = saved_bar

    def prefill_modes(self, n_seqs: int, seq_len: int, reps: int = 3) -> dict[str, Any]:
        """`prefill` (one step of n_seqs fresh prompts) in each attention mode of this engine, same run."""
        out: dict[str, Any] = {}
        for name, (cfg, on_fi) in self.attention_modes().items():
            with self.attention_mode(cfg, on_fi):
                self.prefill(n_seqs, seq_len, reps=1)  # untimed: this mode's kernels for this shape
                out[name] = self.prefill(n_seqs, seq_len, reps)
        return out

    def long_context(self, prompt_len: int, reps: int = 2, goal: str = "") -> dict[str, Any]:
        """TTFT of one prompt (max_tokens 1, chunked prefill at the 8192-token budget), prefix caching on
        but never hit (fresh random prompts), in each of the engine's attention modes (`attention_modes`),
        in the same engine. FLOPs count the causal attention too."""
        eng = self.engine
        modes = self.attention_modes(with_default=False)
        c = self.cfg
        flops = (2.0 * self.linear_params * prompt_len
                 + c.num_layers * _attention_flops(c.num_heads, c.head_dim, [prompt_len], [prompt_len])
                 + 2.0 * c.vocab_size * c.hidden_size)
        out: dict[str, Any] = {"prompt_len": prompt_len, "flops_T": flops / 1e12, "goal": goal, "backends": {}}
        for name, (cfg, on_fi) in modes.items():
            with self.attention_mode(cfg, on_fi):
                if name not in self.warmed_modes:
                    # untimed: two full chunks compile this mode's kernels (a flashinfer engine's warm-up ran
                    # its prefill on FlashInfer, so the Triton kernels for long chunks were not built yet)
                    self.add(self.prompts(1, 16384), 1)
                    while eng.has_unfinished():
                        eng.step()
                    self.warmed_modes.add(name)
                times = []
                for _ in range(reps):
                    self.add(self.prompts(1, prompt_len), 1)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    steps = 0
                    while eng.has_unfinished():
                        eng.step()
                        steps += 1
                    times.append(time.perf_counter() - t)
            ttft = statistics.median(times)
            out["backends"][name] = {"ttft_s": ttft, "all_s": [round(x, 4) for x in times], "steps": steps,
                                     "tflops": flops / ttft / 1e12}
        return out

    def backend_tokens(self, prompt_lens: tuple[int, ...] = (3000, 700, 9000, 130), max_tokens: int = 16,
                       ) -> dict[str, Any]:
        """Engine-level check of `--attention-backend flashinfer`: the same greedy requests (prefix caching
        off, so each mode prefills; a prompt over one 8192-token chunk, mixed prefill+decode steps) with every
        prefill step on FlashInfer (`flashinfer-only`) and on the Triton kernel (`triton`), same engine.
        Random weights: tokens may rightly part where two logits tie within bf16 noise, so the count of
        equal tokens is reported, not asserted."""
        eng = self.engine
        if getattr(eng.runner.backend, "flashinfer_prefill", None) is None:
            return {"skipped": "the engine's backend is not flashinfer"}
        prompts = [self.prompts(1, n)[0] for n in prompt_lens]
        blocks = eng.blocks
        outs: dict[str, list[list[int]]] = {}
        blocks.enable_prefix_caching = False
        try:
            for mode, on in (("flashinfer-only", True), ("triton", False)):
                with self.attention_mode(None, on):
                    ids = self.add(prompts, max_tokens)
                    got: dict[str, list[int]] = {rid: [] for rid in ids}
                    for _ in range(10 * max_tokens + 100):  # bounded
                        for o in eng.step():
                            if o.request_id in got:
                                got[o.request_id] += o.new_token_ids
                        if not eng.has_unfinished():
                            break
                    outs[mode] = [got[rid] for rid in ids]
        finally:
            blocks.enable_prefix_caching = True
        a, b = outs["flashinfer-only"], outs["triton"]
        return {"prompt_lens": list(prompt_lens), "max_tokens": max_tokens,
                "first_token_equal": sum(x[:1] == y[:1] for x, y in zip(a, b, strict=True)),
                "sequences_equal": sum(x == y for x, y in zip(a, b, strict=True)),
                "tokens_equal_before_first_difference": [
                    next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), len(x))
                    for x, y in zip(a, b, strict=True)],
                "lengths": [len(x) for x in a]}

    def offline(self, n_prompts: int, in_len: int, out_len: int, deadline_s: float) -> dict[str, Any]:
        eng = self.engine
        timing = eng.runner.step_timing
        timing.reset()
        ids = self.add(self.prompts(n_prompts, in_len), out_len)
        steps = 0
        graph_wall = 0.0
        graph_wait = 0.0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished():
            if time.perf_counter() - t0 > deadline_s:
                break
            g0, w0 = timing.graph_steps, timing.wait_s
            t = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t
            if timing.graph_steps > g0:
                graph_wall += dt
                graph_wait += timing.wait_s - w0
            steps += 1
        elapsed = time.perf_counter() - t0
        done = n_prompts - sum(1 for r in ids if r in eng.requests)
        generated = sum(len(eng.requests[r].output_token_ids) for r in ids if r in eng.requests) + done * out_len
        finished = not eng.has_unfinished()
        self.drain()
        return {
            "prompts": n_prompts, "in_len": in_len, "out_len": out_len, "completed": finished,
            "finished_prompts": done, "elapsed_s": elapsed, "steps": steps,
            "output_tokens_per_s": generated / elapsed,
            "total_tokens_per_s": (generated + done * in_len) / elapsed if finished else None,
            "cpu_share_all_steps": 1 - timing.wait_s / elapsed,
            "cpu_share_decode_graph_steps": 1 - graph_wait / graph_wall if graph_wall else None,
            "decode_graph_steps": timing.graph_steps,
            "mean_step_ms": elapsed / max(steps, 1) * 1e3,
            "runner_host_s": timing.total_s - timing.wait_s, "runner_wait_s": timing.wait_s,
            "runner_graph_launch_s": timing.launch_s,
            "engine_outside_runner_s": elapsed - timing.total_s,
        }


_KERNEL_KINDS = (  # substring of the kernel name -> what it is, first match wins
    ("_gemv_pairs_kernel", "GEMV + epilogue (qkv+RoPE+KV / gate_up+SiLU)"),
    ("_gemv_kernel", "GEMV"), ("_decode_merge_kernel", "split-KV merge"), ("_decode_kernel", "decode attention"),
    ("_rms_norm_kernel", "RMSNorm"), ("_rope_write_kv_kernel", "RoPE + KV store"),
    ("_silu_and_mul_kernel", "SiLU-and-mul"), ("argmax", "argmax"), ("reduce", "torch reduction"),
    ("gemv", "cuBLAS GEMV"), ("gemm", "cuBLAS GEMM"), ("index", "torch index/gather"),
    ("elementwise", "torch elementwise"), ("Memcpy", "memcpy"), ("Memset", "memset"),
)


def _kernel_kind(name: str) -> str:
    for sub, kind in _KERNEL_KINDS:
        if sub.lower() in name.lower():
            return kind
    return name[:60]


# ---------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".out")))
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting sections past this")
    ap.add_argument("--offline-prompts", type=int, default=1000)
    ap.add_argument("--skip", default="", help="comma-separated section names to skip (any section's name)")
    ap.add_argument("--only", default="", help="comma-separated section names: run only these (plus env and "
                                              "ceilings, and engine_init when an engine section is named)")
    ap.add_argument("--attention-backend", default="auto",
                    help="the engine sections' backend; flashinfer adds its mode to the long-context rows")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(","))) or None
    if only is not None and not only <= PRE_ENGINE:
        only.add("engine_init")
    s = Suite(Path(args.out), args.budget_s, skip, only)
    s.results["flashinfer_h200_reference"] = FLASHINFER_H200
    s.section("env", env_info)
    ceil = s.section("ceilings", ceilings) or {}
    # the 8B logits check needs ~50 GB: before the engine takes 90% of the GPU for its KV pool
    if "kernel_sweeps" in skip and "prefill_attention" not in skip:
        s.section("prefill_attention", prefill_attention_comparison, min_left_s=60)
    s.section("fresh_prompt_breakdown", fresh_prompt_breakdown, min_left_s=30)
    s.section("decode_flashinfer_vs_triton", decode_flashinfer_vs_triton, min_left_s=30)
    for name, fn in (("correctness_kernels", correctness_kernels), ("kernel_sweeps", kernel_sweeps),
                     ("correctness_8b", correctness_8b), ("correctness_engines", correctness_engines)):
        if name not in skip:
            s.section(name, fn, min_left_s=60)
    holder: dict[str, EngineBench] = {}

    def engine_init() -> dict[str, Any]:
        # kept across the sections below; the section records its info
        holder["bench"] = EngineBench(attention_backend=args.attention_backend)
        return holder["bench"].info

    if "engine" not in skip:
        s.section("engine_init", engine_init, min_left_s=60)
    eb = holder.get("bench")
    if eb is not None:
        for name, fn, fargs, min_left in (
            ("p1_decode_b1", eb.decode, (1, 128, eb.p1_steps), 20),
            ("p1_decode_b1_unfused", lambda: eb.p1_variant(False, False, False, False), (), 20),
            ("p1_decode_b1_fused_no_rope_table", lambda: eb.p1_variant(True, True, False, False), (), 20),
            ("p1_decode_b1_fused_no_norm_epilogue", lambda: eb.p1_variant(True, False, False), (), 20),
            ("p1_decode_b1_fused_merge", lambda: eb.p1_variant(True, True, True), (), 20),
            ("p1_decode_b1_again", eb.decode, (1, 128, eb.p1_steps), 20),  # the default again: the drift
            # async scheduling off / on, alternated (issue 21's third pass)
            ("p1_async_off", lambda: eb.decode_async(False), (), 15),
            ("p1_async_on", lambda: eb.decode_async(True), (), 15),
            ("p1_async_off_again", lambda: eb.decode_async(False), (), 15),
            ("p1_async_on_again", lambda: eb.decode_async(True), (), 15),
            ("p2_async_off", lambda: eb.decode_async(False, 64, 2048, 64), (), 20),
            ("p2_async_on", lambda: eb.decode_async(True, 64, 2048, 64), (), 20),
            # long prompts: 8192-token chunks (the code before) vs the prefill-only chunk (the default now)
            ("long_context_chunking_32768", lambda: eb.long_context_chunking(
                32768, ((8192, 0), (8192, 32768), (8192, 16384))), (), 40),
            ("long_context_chunking_65536", lambda: eb.long_context_chunking(65536, ((8192, 0), (8192, 32768))),
             (), 50),
            ("p1_decode_b1_unfused_again", lambda: eb.p1_variant(False, False, False, False), (), 20),
            ("gemv_epilogue_costs", eb.gemv_epilogue_costs, (), 20),
            ("decode_b1_variants", eb.decode_variants_b1, (), 20),
            ("p2_decode_b64_2k", eb.decode, (64, 2048, 64), 30),
            ("p2_no_prefix_cache", eb.decode_no_prefix_cache, (64, 2048, 32), 30),
            ("host_profile_b256", eb.host_profile, (256, 1024, 20), 40),
            ("p3_prefill_1x8192", eb.prefill, (1, 8192), 15),
        ):
            if name not in skip:
                s.section(name, fn, *fargs, min_left_s=min_left)
        for n, length in ((8, 1024), (16, 512), (1, 8192)):
            if "prefill_modes" not in skip:
                s.section(f"prefill_modes_{n}x{length}", eb.prefill_modes, n, length, min_left_s=15)
        if "long" not in skip:
            for n, goal in ((8192, ""), (32768, "goal 75%"), (65536, "goal 72%, TTFT <= 3.8 s"), (131000, "")):
                s.section(f"long_context_{n}", eb.long_context, n, 2, goal, min_left_s=40 if n > 70000 else 20)
        if "backend_tokens" not in skip:
            s.section("backend_tokens", eb.backend_tokens, min_left_s=20)
        if "prefill_8x1024" not in skip:
            s.section("prefill_8x1024", eb.prefill, 8, 1024, min_left_s=15)
        if "offline" not in skip:
            deadline = max(30.0, s.left() - 20)
            s.section("offline", eb.offline, args.offline_prompts, 1024, 512, deadline, min_left_s=40)
    summarize(s, ceil)
    return 0


def summarize(s: Suite, ceil: dict[str, Any]) -> None:
    r = s.results
    bw = ceil.get("copy_rw_GBps")
    bw1 = ceil.get("copy_oneway_GBps")
    mm = ceil.get("matmul_bf16_8192_tflops")
    rows: list[tuple[str, str, str, str]] = []

    def ratio(x: float | None, ceiling: float | None) -> str:
        return f"{100 * x / ceiling:.1f}%" if x and ceiling else "n/a"

    if bw:
        rows.append(("ceiling copy (read+write)", f"{bw:.0f} GB/s", f"one-way {bw1:.0f} GB/s", ""))
    if mm:
        rows.append(("ceiling bf16 matmul 8192^3", f"{mm:.0f} TFLOP/s", "", ""))
    p1 = r.get("p1_decode_b1") or {}
    if "itl_ms" in p1:
        rows.append(("P1 decode b1: weights/ITL", f"{p1['weight_only_GBps']:.0f} GB/s (ITL {p1['itl_ms']:.2f} ms)",
                     f"{ratio(p1['weight_only_GBps'], bw)} of rw copy ({ratio(p1['weight_only_GBps'], bw1)} one-way)",
                     "goal 85%"))
    for key, label in (("p1_decode_b1_unfused", "P1, issue-21 decode fusions off"),
                       ("p1_decode_b1_fused_no_rope_table", "P1, fusions on but the RoPE table"),
                       ("p1_decode_b1_fused_no_norm_epilogue", "P1, fusions on but the add+norm epilogue"),
                       ("p1_decode_b1_fused_merge", "P1, fusions on + the split merge in attention"),
                       ("p1_decode_b1_again", "P1 (default) again"),
                       ("p1_decode_b1_unfused_again", "P1, fusions off again")):
        x = r.get(key) or {}
        if "itl_ms" in x:
            rows.append((label, f"{x['weight_only_GBps']:.0f} GB/s (ITL {x['itl_ms']:.2f} ms)",
                         f"{ratio(x['weight_only_GBps'], bw)} of rw copy", "same run"))
    for key, label in (("p1_async_off", "P1, async scheduling off"), ("p1_async_on", "P1, async scheduling on"),
                       ("p1_async_off_again", "P1, async off again"), ("p1_async_on_again", "P1, async on again")):
        x = r.get(key) or {}
        if "itl_ms" in x:
            rows.append((label, f"{x['weight_only_GBps']:.0f} GB/s (ITL {x['itl_ms']:.2f} ms, device-only "
                         f"{x['device_only_step_ms']:.2f})", f"{ratio(x['weight_only_GBps'], bw)} of rw copy",
                         f"launched ahead {x.get('launched_ahead', 0)}"))
    for key, label in (("p2_async_off", "P2, async scheduling off"), ("p2_async_on", "P2, async scheduling on")):
        x = r.get(key) or {}
        if "itl_ms" in x:
            rows.append((label, f"{x['achieved_GBps']:.0f} GB/s (step {x['itl_ms']:.2f} ms)",
                         f"{ratio(x['achieved_GBps'], bw)} of rw copy", f"launched ahead {x.get('launched_ahead', 0)}"))
    for key, goal in (("long_context_chunking_32768", "goal 75%"), ("long_context_chunking_65536", "goal 72%")):
        lcb = r.get(key) or {}
        for b, x in (lcb.get("settings") or {}).items():
            rows.append((f"TTFT {lcb['prompt_len']} tokens, {b}", f"{x['ttft_s'] * 1e3:.0f} ms",
                         f"{ratio(x['tflops'], mm)} of matmul (causal attention FLOPs counted)", goal))
    p2 = r.get("p2_decode_b64_2k") or {}
    if "itl_ms" in p2:
        rows.append(("P2 decode b64 2k: (W+KV)/step", f"{p2['achieved_GBps']:.0f} GB/s (step {p2['itl_ms']:.2f} ms)",
                     f"{ratio(p2['achieved_GBps'], bw)} of rw copy ({ratio(p2['achieved_GBps'], bw1)} one-way)",
                     "goal 75%"))
    p3 = r.get("p3_prefill_1x8192") or {}
    if "tflops" in p3:
        rows.append(("P3 prefill 1x8192", f"{p3['tflops']:.0f} TFLOP/s ({p3['step_s'] * 1e3:.0f} ms)",
                     f"{ratio(p3['tflops'], mm)} of matmul", "goal 65%"))
    p8 = r.get("prefill_8x1024") or {}
    if "tflops" in p8:
        rows.append(("prefill 8x1024", f"{p8['tflops']:.0f} TFLOP/s ({p8['step_s'] * 1e3:.0f} ms)",
                     f"{ratio(p8['tflops'], mm)} of matmul", ""))
    ks = r.get("kernel_sweeps") or {}
    if "decode_b8_kv2048_best_us" in ks:
        rows.append(("decode kernel b8 kv2048", f"{ks['decode_b8_kv2048_best_us']:.1f} us",
                     f"FlashInfer {FLASHINFER_H200['decode_b8_kv2048_us']} us (h200-facts.md, another run)", ""))
    pc = r.get("prefill_attention") or ks
    for shape in PREFILL_SHAPES:
        ours = pc.get(f"{shape}_ours_tflops") or {}
        best = pc.get(f"{shape}_best_library_tflops")
        if ours:
            fi_tf = (pc.get(f"{shape}_library_tflops") or {}).get("flashinfer_paged")
            txt = ", ".join(f"{k} {v:.0f}" for k, v in ours.items() if v) + (f"; FlashInfer {fi_tf:.0f}" if fi_tf
                                                                               else "")
            rows.append((f"prefill attention {shape}", f"{txt} TFLOP/s",
                         f"{ratio(max(v for v in ours.values() if v), best)} of best library ({best or 0:.0f})",
                         "goal 90%"))
    for _key, lc in sorted((k, v) for k, v in r.items() if k.startswith("long_context_") and isinstance(v, dict)):
        for bn, x in (lc.get("backends") or {}).items():
            if "ttft_s" in x:
                rows.append((f"TTFT {lc['prompt_len']} tokens ({bn})", f"{x['ttft_s'] * 1e3:.0f} ms",
                             f"{ratio(x['tflops'], mm)} of matmul (causal attention FLOPs counted)",
                             lc.get("goal", "")))
    off = r.get("offline") or {}
    if "output_tokens_per_s" in off:
        rows.append((f"offline {off['prompts']}x(1024->512)", f"{off['output_tokens_per_s']:.0f} out tok/s",
                     f"CPU share {100 * off['cpu_share_all_steps']:.1f}% (decode steps "
                     f"{100 * (off['cpu_share_decode_graph_steps'] or 0):.1f}%)",
                     "complete" if off["completed"] else "PARTIAL (deadline)"))
    for key in ("correctness_kernels", "correctness_engines", "correctness_8b"):
        v = r.get(key) or {}
        rows.append((key, "PASS" if v.get("ok") else ("FAIL" if "ok" in v else str(v)[:60]), "", ""))
    md = ["| metric | value | ratio | note |", "|---|---|---|---|"] + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    (s.out / "gpu_suite.md").write_text(f"# GPU suite {r['date']}\n\n" + "\n".join(md) + "\n")
    s.results["summary_rows"] = rows
    s.save()
    print("\n".join(md), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
