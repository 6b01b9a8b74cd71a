"""The CUDA fp8 decode kernel (pdserve/attention/csrc/fp8_decode.cu) vs the Triton one, on one GPU, one run:
correctness against SDPA over the dequantized pool, then one layer's decode time side by side with the bf16
pool's Triton kernel (CUDA-graph timed, Llama-3.1-8B heads).

    PYTHONUNBUFFERED=1 python benchmarks/fp8_decode_cuda.py --out $OUT [--quick]

Writes $OUT/fp8_decode_cuda.json and prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pdserve.attention import cuda_fp8_decode as cfd  # noqa: E402
from pdserve.attention import fp8_kv  # noqa: E402
from pdserve.attention import triton_backend as tb  # noqa: E402
from pdserve.attention import triton_kernels as tk  # noqa: E402
from pdserve.testing.gpu_correctness import SdpaReference, fp8_case, make_paged_case, rel_err  # noqa: E402

# (name, seq lens, heads, kv heads, block size)
CASES = [
    ("g4 mixed", [1, 17, 300, 4096], 32, 8, 16),
    ("g8", [33, 1000], 32, 4, 16),
    ("g1", [5, 129], 8, 8, 16),
    ("g2 bs32", [47, 300], 16, 8, 32),
]
TOL = 2e-2  # 16-bit queries: the products run in float16 (the Triton kernel's tolerance in gpu_correctness)


def correctness(quick: bool) -> list[dict[str, Any]]:
    ref = SdpaReference(torch.float32)
    rows = []
    for fmt_name in ("fp8_e4m3",) if quick else ("fp8_e4m3", "fp8_e5m2"):
        fmt = fp8_kv.fp8_format(fmt_name)
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16):
            for n, (name, seqs, h, kvh, bs) in enumerate(CASES):
                c8, cf = fp8_case(make_paged_case([1] * len(seqs), seqs, h, kvh, 128, dtype=dtype, seed=50 + n,
                                                  block_size=bs), fmt_name)
                scale = 128**-0.5
                want = ref.forward(cf.q, cf.k_cache, cf.v_cache, cf.meta, scale).float()
                # stale V bytes past each end (the format's largest code): probabilities 0, results unchanged
                values, _ = fp8_kv.layer_views(c8.v_cache, is_v=True)
                for b, s in enumerate(seqs):
                    values[int(c8.meta.block_tables[b, (s - 1) // bs]), :, (s - 1) % bs + 1:] = (
                        0x7E if fmt_name == "fp8_e4m3" else 0x7B)
                for stages in cfd.STAGES:
                    for splits in (1, 3):
                        out = torch.full_like(c8.q, float("nan"))
                        cfd.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens,
                                             scale, splits, fmt, stages=stages, out=out)
                        err = rel_err(out, want)
                        tri = torch.full_like(c8.q, float("nan"))
                        tk.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens,
                                            scale, splits, out=tri, kv_format=fmt)
                        rows.append({"case": name, "fmt": fmt_name, "dtype": str(dtype), "stages": stages,
                                     "splits": splits, "rel_err": err, "triton_rel_err": rel_err(tri, want),
                                     "cuda_vs_triton": rel_err(out, tri.float()), "ok": err < TOL})
                # a padding row (seq_len 0) gets zeros
                lens = c8.meta.seq_lens.clone()
                lens[0] = 0
                out = torch.full_like(c8.q, float("nan"))
                cfd.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, lens, scale, 1, fmt, out=out)
                rows.append({"case": name + ", padding row", "fmt": fmt_name, "dtype": str(dtype),
                             "ok": bool((out[0] == 0).all()) and rel_err(out[1:], want[1:]) < TOL})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _time_batch(batch: int, ctx: int, heads: int, kvh: int, d: int) -> dict[str, Any]:
    from gpu_suite import graph_us

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    fmt = fp8_kv.fp8_format("fp8_e4m3")
    scale = d**-0.5
    c = make_paged_case([1] * batch, [ctx] * batch, heads, kvh, d, seed=3, num_layers=1, spare_blocks=0)
    c8, _ = fp8_case(c, "fp8_e4m3")
    out = torch.empty_like(c.q)
    kv_bytes = {"bf16": batch * ctx * kvh * 2 * d * 2, "fp8": batch * ctx * kvh * 2 * (d + fp8_kv.SCALE_BYTES)}
    row: dict[str, Any] = {"batch": batch, "kv_bytes": kv_bytes}

    def triton(case, cfg, kv_format):
        tile_n, warps, stages, pps, max_regs = cfg
        splits = tk.decode_num_splits(batch, kvh, num_sms, pps)
        return lambda: tk.decode_attention(case.q, case.k_cache, case.v_cache, case.meta.block_tables,
                                           case.meta.seq_lens, scale, splits, out=out, tile_n=tile_n,
                                           num_warps=warps, num_stages=stages, kv_format=kv_format,
                                           max_regs=max_regs)

    def cuda(stages, splits):
        return lambda: cfd.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens,
                                            scale, splits, fmt, stages=stages, out=out)

    us = graph_us(triton(c, tb.decode_config(batch), None))
    row["bf16_triton"] = {"us": us, "GBps": kv_bytes["bf16"] / us / 1e3}
    us = graph_us(triton(c8, tb.decode_config(batch, tb.FP8_DECODE_CONFIGS), fmt))
    row["fp8_triton"] = {"us": us, "GBps": kv_bytes["fp8"] / us / 1e3}
    cuda_rows: list[dict[str, Any]] = []
    for stages in cfd.STAGES:
        for pps in (1, 2, 3, 4, 8):
            splits = tk.decode_num_splits(batch, kvh, num_sms, pps)
            if any(r["stages"] == stages and r["splits"] == splits for r in cuda_rows):
                continue
            us = graph_us(cuda(stages, splits))
            cuda_rows.append({"stages": stages, "splits": splits, "us": us, "GBps": kv_bytes["fp8"] / us / 1e3})
    row["fp8_cuda"] = cuda_rows
    best = min(cuda_rows, key=lambda r: r["us"])
    row["fp8_cuda_best"] = best
    row["speedup_cuda_vs_triton_fp8"] = row["fp8_triton"]["us"] / best["us"]
    row["speedup_cuda_fp8_vs_bf16"] = row["bf16_triton"]["us"] / best["us"]
    return row


def timing(quick: bool) -> dict[str, Any]:
    heads, kvh, d, ctx = 32, 8, 128, 4096
    res: dict[str, Any] = {"context": ctx, "heads": heads, "kv_heads": kvh, "rows": []}
    for batch in (64,) if quick else (64, 1, 8, 24):
        row = _time_batch(batch, ctx, heads, kvh, d)
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="one format and dtype, batch 64 only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    cfd.library(torch.device("cuda"))
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
                               "gpu": torch.cuda.get_device_name(0), "build_s": time.perf_counter() - t}
    path = args.out / "fp8_decode_cuda.json"
    for name, fn in (("correctness", correctness), ("timing", timing)):
        results[name] = fn(args.quick)
        path.write_text(json.dumps(results, indent=1, default=str))
    bad = [r for r in results["correctness"] if not r["ok"]]
    print(f"correctness: {len(results['correctness']) - len(bad)}/{len(results['correctness'])} ok", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
