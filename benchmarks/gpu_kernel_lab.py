"""Kernel lab for issue 21, one device call: the prefill kernel's launch configurations, old (v1) and new,
for the shapes long-context prefill meets; and batch-1 GEMVs (Triton, plain and with the RMSNorm or SiLU
fused into the prologue) against cuBLAS. Its first run (2026-12-01) also timed torch SDPA's backends and a
first long-prefill path, which became gpu_suite.py's prefill_attention_comparison.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_kernel_lab.py --out $OUT [--sections attn,gemv]

Writes $OUT/kernel_lab.json and prints a table per section. Ceilings are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, KVH, D = 32, 8, 128  # Llama-3.1-8B's attention shape
SHAPES: dict[str, tuple[list[int], list[int]]] = {
    "b8_q512_kv2048": ([512] * 8, [2048] * 8),
    "1x8192": ([8192], [8192]),
    "c8192@32k": ([8192], [32768]),
    "c8192@64k": ([8192], [65536]),
    "c8192@128k": ([8192], [131072]),
}


def time_ms(fn, target_s: float = 0.25, max_iters: int = 20) -> float:
    """Median ms per call (CUDA events), after one warm-up call that also sizes the repetitions."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t
    iters = max(3, min(max_iters, int(target_s / max(once, 1e-6))))
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn) -> float:
    """Median ms of fn replayed from a CUDA graph (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_ms(g.replay)


def flops_of(q_lens: list[int], s_lens: list[int]) -> float:
    from pdserve.attention.long_prefill import causal_chunk_flops

    return sum(causal_chunk_flops(H, D, q, s) for q, s in zip(q_lens, s_lens, strict=True))


def ceilings() -> dict[str, Any]:
    n = 8192
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    mm = 2 * n**3 / time_ms(lambda: a @ b) / 1e9
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    cp = 2 * 2**30 / time_ms(lambda: dst.copy_(src)) / 1e6
    return {"matmul_tflops": mm, "copy_rw_GBps": cp}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.double()
    want = want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm())


# ---------------------------------------------------------------------------------------------------
def attention_section(res: dict[str, Any]) -> None:
    """The prefill kernel before issue 21 (v1) against the current one, over launch configurations. The
    comparison with the library kernels and the long-prefill path is gpu_suite.py's
    prefill_attention_comparison."""
    from benchmarks.lab.prefill_v1 import prefill_attention_v1
    from pdserve.attention import triton_kernels as tk
    from pdserve.testing.gpu_correctness import make_paged_case

    rows: list[dict[str, Any]] = []
    res["attention"] = rows
    cfgs = [(128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 4),
            (64, 64, 4, 3), (128, 64, 4, 4)]
    for name, (q_lens, s_lens) in SHAPES.items():
        flops = flops_of(q_lens, s_lens)
        c = make_paged_case(q_lens, s_lens, H, KVH, D, num_layers=8, seed=3)
        m = c.meta
        variants = [("v1", prefill_attention_v1, (128, 128, 8, 3))] + [("v2", tk.prefill_attention, g) for g in cfgs]
        for label, fn_, (bm, tn, w, st) in variants:
            row = {"shape": name, "kind": f"triton-{label} {bm}/{tn}/{w}/{st}"}
            try:
                ms = time_ms(lambda fn_=fn_, bm=bm, tn=tn, w=w, st=st, c=c, m=m: fn_(
                    c.q, c.k_cache, c.v_cache, m.block_tables, m.seq_lens, m.query_start_loc, D**-0.5,
                    len(m.seq_lens_host), block_m=bm, tile_n=tn, num_warps=w, num_stages=st))
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(f"  {name:16s} {row['kind']:28s} {row.get('tflops', 0):7.1f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
def gemv_section(res: dict[str, Any], bw: float | None) -> None:
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    cfgs = [(8, 512, 4), (16, 512, 4), (8, 1024, 4), (16, 1024, 8), (4, 1024, 4), (32, 256, 4), (8, 2048, 8),
            (4, 2048, 4)]
    rows: list[dict[str, Any]] = []
    res["gemv"] = rows
    for name, (n, k) in shapes.items():
        _gemv_shape(rows, name, n, k, cfgs, bw)
        torch.cuda.empty_cache()


def _gemv_shape(rows: list[dict[str, Any]], name: str, n: int, k: int, cfgs: list[tuple[int, int, int]],
                bw: float | None) -> None:
    import torch.nn.functional as F

    from benchmarks.lab import gemv as gk

    nbytes = n * k * 2
    copies = max(2, min(16, math.ceil(512e6 / nbytes)))
    ws = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
    y = torch.empty((1, n), device="cuda", dtype=torch.bfloat16)
    want = (ws[0].float() @ x[0].float())

    def add(kind: str, fn, check=None, **extra):
        row = {"shape": name, "kind": kind, **extra}
        try:
            if check is not None:
                row["rel_err"] = check()
            ms = graph_ms(fn) / copies
            row.update(us=ms * 1e3, GBps=nbytes / ms / 1e6)
            if bw:
                row["pct_copy_rw"] = 100 * row["GBps"] / bw
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(f"  {name:8s} {kind:28s} {row.get('us', 0):8.1f} us {row.get('GBps', 0):7.0f} GB/s "
              f"err {row.get('rel_err', 0):.1e} {row.get('error', '')[:100]}", flush=True)

    add("cublas F.linear", lambda: [F.linear(x, w) for w in ws],
        check=lambda: rel_err(F.linear(x, ws[0])[0], want))
    for bn, bk, wp in cfgs:
        if k % bk:
            continue
        add(f"triton {bn}/{bk}/{wp}", lambda bn=bn, bk=bk, wp=wp: [gk.gemv(w, x, y, bn, bk, wp) for w in ws],
            check=lambda bn=bn, bk=bk, wp=wp: rel_err(gk.gemv(ws[0], x, y, bn, bk, wp)[0], want))
    if name in ("qkv", "gate_up", "o"):
        r_in = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        r_out = torch.empty_like(r_in)
        nw = torch.randn(k, device="cuda", dtype=torch.bfloat16) * 0.1 + 1
        hh = (x.float() + r_in.float()).to(torch.bfloat16).float()
        xn = (hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16).float() * nw.float()
        want_n = ws[0].float() @ xn.to(torch.bfloat16).float()[0]
        for bn, bk, wp in cfgs[:4]:
            add(f"triton+norm {bn}/{bk}/{wp}",
                lambda bn=bn, bk=bk, wp=wp: [gk.gemv_norm(w, x, r_in, r_out, nw, y, 1e-5, bn, bk, wp) for w in ws],
                check=lambda bn=bn, bk=bk, wp=wp: rel_err(
                    gk.gemv_norm(ws[0], x, r_in, r_out, nw, y, 1e-5, bn, bk, wp)[0], want_n))
    if name == "down":
        gu = torch.randn((1, 2 * k), device="cuda", dtype=torch.bfloat16)
        act = (F.silu(gu[:, :k]) * gu[:, k:]).float()
        want_s = ws[0].float() @ act[0]
        for bn, bk, wp in cfgs[:4]:
            add(f"triton+silu {bn}/{bk}/{wp}",
                lambda bn=bn, bk=bk, wp=wp: [gk.gemv_silu(w, gu, y, bn, bk, wp) for w in ws],
                check=lambda bn=bn, bk=bk, wp=wp: rel_err(gk.gemv_silu(ws[0], gu, y, bn, bk, wp)[0], want_s))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / ".out"))
    ap.add_argument("--sections", default="attn,gemv")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
                           "triton": triton.__version__, "device": torch.cuda.get_device_name(0),
                           "cudnn": torch.backends.cudnn.version()}
    t0 = time.perf_counter()
    res["ceilings"] = ceilings()
    print("ceilings:", res["ceilings"], flush=True)
    for sec in args.sections.split(","):
        t = time.perf_counter()
        try:
            if sec == "attn":
                attention_section(res)
            elif sec == "gemv":
                gemv_section(res, res["ceilings"].get("copy_rw_GBps"))
        except Exception:  # noqa: BLE001
            res[f"{sec}_error"] = traceback.format_exc()
            traceback.print_exc()
        print(f"== {sec} done in {time.perf_counter() - t:.0f} s", flush=True)
        (out / "kernel_lab.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
