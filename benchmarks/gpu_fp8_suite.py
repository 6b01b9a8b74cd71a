"""FP8 KV cache on the GPU (issue 17), side by side with bf16 KV, in one device call.

Writes $OUT/gpu_fp8_suite.json (every number, saved after each section) and prints a summary last.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_fp8_suite.py --out $OUT [--budget-s 480] [--skip pd1,nixl]
    python benchmarks/gpu_fp8_suite.py --small --out "$(mktemp -d)"     # CPU dry run of the plumbing

Sections (each bounded; a failure is recorded and the next runs):
- ceilings: 1 GiB device-to-device copy (bytes read + written per second).
- kernels: the fp8 kernels vs SDPA on the dequantized pool (bf16), the K/V stores byte-exact vs fp8_kv.
- decode_kernel: one layer's decode attention at batch 64, 4k context (Llama-3.1-8B heads), bf16 pool at
  its tuned config vs the fp8 pool over a small config sweep (CUDA-graph timed); the winner is what the
  fp8 engine below captures its graphs with (PDSERVE_FP8_DECODE=triton). Then the CUDA fp8 decode kernel
  (cuda_fp8_decode.py, the default where it builds and passes its check) over its own small sweep.
- engine_bf16 / engine_fp8 (the Triton fp8 kernel) / engine_fp8_cuda (the default: the CUDA kernel at its
  default settings): Llama-3.1-8B shape, dummy weights, gpu_memory_utilization 0.9: KV blocks at the same
  memory; decode step at batch 64 with 4k context ((weights + KV bytes) / step vs the copy ceiling); TTFT of a
  32k prompt with and without the cuDNN long-prefill path (fp8 dequantizes each chunk for cuDNN). With
  --prefill-profile, engine_bf16 also profiles one 8192-token prefill step (EngineBench.prefill_profile).
  --repeat-engines N measures the three engines' decode steps N times, alternated.
- accuracy: SmolLM2-135M (embedded), bf16, 50 prompts x 64 greedy tokens: fp8 vs bf16 KV, and the
  "capital of France" answer (benchmarks/bench_kv_fp8_accuracy.py).
- nixl: NIXL READ of an 8k-token prompt's KV, bf16 vs fp8 pool (benchmarks/bench_kv_transfer.py).
- pd1: the seed's 1P1D workload as gpu_pd_suite.sh pd1 runs it (bench_pd.py, P and D sharing the GPU,
  8192 in / 64 out, 5 requests), bf16 vs `--kv-cache-dtype fp8`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (tile_n, num_warps, num_stages, programs per SM, register cap) tried for the fp8 decode kernel at batch 64 (at
# 4 per SM the b64 x 8-head grid splits each sequence in 2, with a merge kernel after). Earlier runs (V
# token-major; results/h200-fp8-kv/gpu_fp8_suite_sweep_{4,5}.json) swept ways of decoding the tiles: all
# 210-260 us. With V dim-major and e4m3 by the conversion instruction (run 6,
# results/h200-fp8-kv/gpu_fp8_suite_vt_*.json): (128, 4, 2, 4, 128) 152 us, uncapped 171, 8 per SM 157, 3 stages
# 159, 64-token tiles 180, 256-token tiles on 8 warps 191-210; unsplit at 2 per SM with the cap 135.
FP8_DECODE_SWEEP = [
    (128, 4, 2, 2, 128), (128, 4, 2, 4, 128), (128, 4, 2, 2, None), (128, 4, 2, 3, 128),
]
# smaller batches (their buckets' configs), same context
FP8_DECODE_SMALL = [1, 8]
# (stages, programs per SM for the splits) of the CUDA fp8 decode kernel (pdserve/attention/cuda_fp8_decode.py,
# the default) at batch 64: 3 stages fit 4 CTAs per SM, 4 stages 3, 6 stages 2; 2 programs per SM leave
# batch 64 unsplit (512 CTAs), 4 split it in two
CUDA_FP8_DECODE_SWEEP = [(3, 2), (3, 4), (2, 2), (4, 2), (6, 2)]


class Run:
    """Sections under one time budget; results saved after each one."""

    def __init__(self, out: Path, budget_s: float, skip: set[str]):
        self.out = out
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.skip = skip
        self.results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def section(self, name: str, fn, *args, min_left_s: float = 0.0, **kwargs) -> Any:
        if name in self.skip:
            return None
        if self.left() < min_left_s:
            self.results[name] = {"skipped": f"{self.left():.0f} s left, needs {min_left_s:.0f}"}
            print(f"--- {name}: skipped (budget)", flush=True)
            return None
        print(f"--- {name} (t={time.perf_counter() - self.t0:.0f} s)", flush=True)
        t = time.perf_counter()
        try:
            res = fn(*args, **kwargs)
            self.results[name] = res
        except Exception as e:  # noqa: BLE001 - record and go on: one call must bring back what it can
            traceback.print_exc()
            res = None
            self.results[name] = {"error": f"{type(e).__name__}: {e}"}
        self.results.setdefault("section_s", {})[name] = round(time.perf_counter() - t, 1)
        self.save()
        return res

    def save(self) -> None:
        (self.out / "gpu_fp8_suite.json").write_text(json.dumps(self.results, indent=1, default=str))


def ceilings() -> dict[str, Any]:
    from gpu_suite import _copy_seconds

    nbytes = 2**30
    t = _copy_seconds(nbytes)
    return {"copy_1gib_rw_GBps": 2 * nbytes / t / 1e9, "copy_1gib_oneway_GBps": nbytes / t / 1e9}


def kernels(small: bool) -> dict[str, Any]:
    from pdserve.testing.gpu_correctness import KERNEL_CASES, check_fp8_kernels

    if small:  # CPU dry run under the interpreter: tiny shapes
        cases = [{"name": "tiny", "q": [3, 1], "s": [9, 5], "h": 4, "kvh": 2, "d": 16},
                 {"name": "tiny-decode", "q": [1, 1], "s": [9, 30], "h": 4, "kvh": 2, "d": 16}]
        res = check_fp8_kernels(torch.float32, "cpu", cases, ("fp8_e4m3",), block_size=4, tile_n=16, block_m=16,
                                splits_list=(1, 2))
    else:
        res = check_fp8_kernels(torch.bfloat16, "cuda", KERNEL_CASES)
    return {"all_ok": all(r["ok"] for r in res), "worst_rel_err": max(r.get("rel_err", 0.0) for r in res),
            "results": res}


def decode_kernel(small: bool, small_batches: bool = True, cuda_decode: bool = False) -> dict[str, Any]:
    """One layer of decode attention, bf16 pool vs fp8 pool (same random values, quantized)."""
    from gpu_suite import graph_us

    from pdserve.attention import fp8_kv
    from pdserve.attention import triton_backend as tb
    from pdserve.attention import triton_kernels as tk
    from pdserve.testing.gpu_correctness import SdpaReference, fp8_case, make_paged_case, rel_err

    batch, ctx, heads, kvh, d = (4, 64, 4, 2, 16) if small else (64, 4096, 32, 8, 128)
    dev = "cpu" if small else "cuda"
    c = make_paged_case([1] * batch, [ctx] * batch, heads, kvh, d, dtype=torch.bfloat16 if not small else
                        torch.float32, device=dev, seed=3, num_layers=2, spare_blocks=0)
    c8, cf = fp8_case(c, "fp8_e4m3")
    fmt = fp8_kv.fp8_format("fp8_e4m3")
    scale = d**-0.5
    num_sms = 4 if small else torch.cuda.get_device_properties(0).multi_processor_count
    timer = (lambda fn: (fn(), 0.0)[1]) if small else graph_us
    out = torch.empty_like(c.q)

    def run(case, cfg, kv_format, rows=batch):
        tile_n, warps, stages, pps, max_regs = cfg
        splits = tk.decode_num_splits(rows, kvh, num_sms, pps)
        return lambda: tk.decode_attention(case.q[:rows], case.k_cache, case.v_cache, case.meta.block_tables[:rows],
                                           case.meta.seq_lens[:rows], scale, splits, out=out[:rows], tile_n=tile_n,
                                           num_warps=warps, num_stages=stages, kv_format=kv_format,
                                           max_regs=None if small else max_regs)

    kv_bytes = {"bf16": batch * ctx * kvh * 2 * d * 2, "fp8": batch * ctx * kvh * 2 * (d + fp8_kv.SCALE_BYTES)}
    bf16_cfg = tb.decode_config(batch)
    res: dict[str, Any] = {"batch": batch, "context": ctx, "heads": heads, "kv_heads": kvh, "head_dim": d,
                           "kv_bytes_per_layer": kv_bytes}
    us = timer(run(c, bf16_cfg, None))
    res["bf16"] = {"config": bf16_cfg, "us": us, "GBps": kv_bytes["bf16"] / max(us, 1e-9) / 1e3}
    want = SdpaReference(torch.float32).forward(cf.q, cf.k_cache, cf.v_cache, cf.meta, scale)
    sweep = []
    # first: the fp8 kernel as the backend runs it at this batch (its bucket's config)
    was = tb.decode_config(batch, tb.FP8_DECODE_CONFIGS)
    sweep_cfgs = [bf16_cfg] if small else [was, *FP8_DECODE_SWEEP]
    for cfg in sweep_cfgs:
        try:
            fn = run(c8, cfg, fmt)
            us = timer(fn)
            out.fill_(float("nan"))
            fn()
            sweep.append({"config": cfg, "us": us, "GBps": kv_bytes["fp8"] / max(us, 1e-9) / 1e3,
                          "rel_err": rel_err(out, want)})
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            sweep.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(sweep[-1]), flush=True)
    small_rows = []
    for rows in FP8_DECODE_SMALL if small_batches else []:  # bf16, fp8 at the bucket's config
        if rows > batch:
            continue
        cfg = tb.decode_config(rows, tb.FP8_DECODE_CONFIGS)
        row = {"batch": rows, "config": cfg, "bf16_us": timer(run(c, tb.decode_config(rows), None, rows)),
               "fp8_us": timer(run(c8, cfg, fmt, rows))}
        small_rows.append(row)
        print(json.dumps(row), flush=True)
    res["fp8_small_batches"] = small_rows
    if not small and cuda_decode:
        res.update(_cuda_decode_sweep(c8, fmt, scale, out, want, kv_bytes["fp8"], num_sms, timer))
    ok = [s for s in sweep if "us" in s and s["rel_err"] < 2e-2]
    best = min(ok, key=lambda s: s["us"]) if ok else None
    res["fp8_sweep"] = sweep
    res["fp8_best"] = best
    if best is not None and not small:
        res["speedup_fp8_vs_bf16"] = res["bf16"]["us"] / best["us"]
    return res


def _cuda_decode_sweep(c8, fmt, scale: float, out: torch.Tensor, want: torch.Tensor, kv_bytes: int, num_sms: int,
                       timer) -> dict[str, Any]:
    """The CUDA fp8 decode kernel on decode_kernel's batch-64 case, over CUDA_FP8_DECODE_SWEEP."""
    from pdserve.attention import cuda_fp8_decode as cfd
    from pdserve.attention import triton_kernels as tk
    from pdserve.testing.gpu_correctness import rel_err

    if not cfd.usable(c8.q, c8.k_cache, fmt):
        return {"fp8_cuda_skipped": cfd.build_error(c8.q.device) or "the kernel does not take this shape"}
    rows = []
    for stages, pps in CUDA_FP8_DECODE_SWEEP:
        splits = tk.decode_num_splits(c8.q.shape[0], c8.k_cache.shape[2], num_sms, pps)

        def fn(stages=stages, splits=splits):
            return cfd.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens, scale,
                                        splits, fmt, stages=stages, out=out)

        try:
            us = timer(fn)
            out.fill_(float("nan"))
            fn()
            rows.append({"stages": stages, "programs_per_sm": pps, "splits": splits, "us": us,
                         "GBps": kv_bytes / max(us, 1e-9) / 1e3, "rel_err": rel_err(out, want)})
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            rows.append({"stages": stages, "programs_per_sm": pps, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
    return {"fp8_cuda_sweep": rows, "fp8_cuda_best": min(ok, key=lambda r: r["us"]) if ok else None}


def engine_with_cuda_decode(best: dict | None, batch: int, ctx: int, stages: int | None = None) -> dict[str, Any]:
    """engine("fp8") as shipped: the CUDA decode kernel at its default settings (PDSERVE_FP8_DECODE unset), or
    at `stages` pipeline stages; the sweep's best beside it for the record, and which kernel the backend took."""
    from pdserve.attention import cuda_fp8_decode as cfd

    os.environ.pop("PDSERVE_FP8_DECODE", None)
    saved = cfd.DEFAULT_STAGES
    cfd.DEFAULT_STAGES = stages or saved
    try:
        used = {"stages": cfd.DEFAULT_STAGES, "programs_per_sm": cfd.PROGRAMS_PER_SM, "default_stages": saved}
        res = engine("fp8", batch, ctx, 0)
    finally:
        cfd.DEFAULT_STAGES = saved
    return {"cuda_decode": used, "sweep_best": best,
            "cuda_kernel_taken": cfd._device_library(torch.cuda.current_device()) is not None, **res}


def engine_triton_fp8(batch: int, ctx: int, long_prompt: int) -> dict[str, Any]:
    """engine("fp8") with the Triton fp8 decode kernel (PDSERVE_FP8_DECODE=triton)."""
    os.environ["PDSERVE_FP8_DECODE"] = "triton"
    try:
        return engine("fp8", batch, ctx, long_prompt)
    finally:
        os.environ.pop("PDSERVE_FP8_DECODE", None)


def use_fp8_decode_config(cfg: tuple, batch: int) -> dict:
    """Make the fp8 decode config of `batch`'s bucket `cfg` (the sweep's winner: tile, warps, stages, programs
    per SM, register cap) for the engine built next in this process."""
    from pdserve.attention import triton_backend as tb

    table = [list(row) for row in tb.FP8_DECODE_CONFIGS]
    for row in table:
        if batch <= row[0]:
            row[1:] = list(cfg[:5])
            break
    tb.FP8_DECODE_CONFIGS = [tuple(row) for row in table]
    return {"configs": tb.FP8_DECODE_CONFIGS}


def engine(kv_cache_dtype: str, batch: int, ctx: int, long_prompt: int, prefill_profile: bool = False,
           steps: int = 24) -> dict[str, Any]:
    from gpu_suite import EngineBench

    eb = EngineBench(max_model_len=max(long_prompt, ctx + 256, 8192) + 64, max_num_seqs=batch,
                     kv_cache_dtype=kv_cache_dtype)
    try:
        res: dict[str, Any] = {"info": eb.info}
        res["decode"] = eb.decode(batch, ctx, steps)
        if prefill_profile:
            res["prefill_profile_8192"] = eb.prefill_profile(8192)
        if long_prompt:
            res["long_context"] = eb.long_context(long_prompt, reps=2)
        return res
    finally:
        eb.engine.shutdown()
        del eb
        gc.collect()
        torch.cuda.empty_cache()


def accuracy(small: bool) -> dict[str, Any]:
    from dataclasses import asdict

    from bench_kv_fp8_accuracy import measure, print_rows, prompts

    n, tokens = (2, 4) if small else (50, 64)
    rows = measure(prompts(n), tokens, ["fp8_e4m3", "fp8_e5m2"], "cpu" if small else "cuda",
                   "float32" if small else "bfloat16")
    print_rows(rows)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"rows": [asdict(r) for r in rows]}


def _script(cmd: list[str], timeout: float) -> dict[str, Any]:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if not ln.startswith("[")]
    print("\n".join(lines[-14:]), flush=True)
    return {"cmd": " ".join(cmd), "rc": p.returncode, "tail": lines[-14:], "s": round(time.perf_counter() - t, 1)}


def nixl(small: bool, per_run_s: float, out: Path) -> dict[str, Any]:
    """NIXL READ, bf16 vs fp8 pool: 2k/4k/8k-token prompts interleaved in one run per dtype (30 READs each,
    medians; the fit of time = fixed + bytes / rate says what the fixed per-READ cost is), then the 8k prompt
    scattered (one descriptor per block) to see whether descriptor count is the fixed cost."""
    if small:
        runs = {"": ["--tokens", "32,64", "--device", "cpu", "--iters", "2"]}
    else:
        runs = {"": ["--tokens", "2048,4096,8192", "--device", "cuda:0", "--iters", "21"],
                "_scatter": ["--tokens", "8192", "--device", "cuda:0", "--iters", "9", "--scatter"]}
    res: dict[str, Any] = {}
    for tag, args in runs.items():
        for dt in ("bf16", "fp8"):
            path = out / f"nixl_{dt}{tag}.json"
            res[f"{dt}{tag}"] = _script([sys.executable, "benchmarks/bench_kv_transfer.py", *args, "--dtype", dt,
                                         "--json", str(path)], per_run_s)
            if path.exists():
                res[f"{dt}{tag}"]["report"] = {k: v for k, v in json.loads(path.read_text()).items()}
    return res


def pd1(small: bool, per_run_s: float, tokenizer: str) -> dict[str, Any]:
    """gpu_pd_suite.sh's pd1 (P and D sharing the GPU), the 1P1D legs only, bf16 then fp8 KV."""
    base = [sys.executable, "benchmarks/bench_pd.py", "--pd-only", "--load-format", "dummy",
            "--serve-arg=--tokenizer", f"--serve-arg={tokenizer}", "--serve-arg=--max-num-seqs", "--serve-arg=64"]
    if small:
        base += ["--model", "smollm2-135m", "--prompt-len", "64", "--output-len", "8", "--num-requests", "1"]
    else:
        base += ["--model", "Llama-3.1-8B", "--gpu", "--prompt-len", "8192", "--output-len", "64",
                 "--num-requests", "5"]
    out = {"bf16": _script(base, per_run_s)}
    out["fp8"] = _script([*base, "--serve-arg=--kv-cache-dtype", "--serve-arg=fp8"], per_run_s)
    return out


def summarize(r: dict[str, Any]) -> None:
    def get(*keys, default=None):
        x: Any = r
        for k in keys:
            if not isinstance(x, dict) or k not in x:
                return default
            x = x[k]
        return x

    copy = get("ceilings", "copy_1gib_rw_GBps")
    print("\n=== summary")
    print(f"kernels ok: {get('kernels', 'all_ok')}, worst rel err {get('kernels', 'worst_rel_err')}")
    dk = r.get("decode_kernel") or {}
    if "bf16" in dk and dk.get("fp8_best"):
        print(f"decode kernel b{dk['batch']} ctx {dk['context']}: bf16 {dk['bf16']['us']:.1f} us "
              f"({dk['bf16']['GBps']:.0f} GB/s) vs fp8 {dk['fp8_best']['us']:.1f} us ({dk['fp8_best']['GBps']:.0f} "
              f"GB/s, config {dk['fp8_best']['config']}): {dk.get('speedup_fp8_vs_bf16', 0):.2f}x")
    if dk.get("fp8_cuda_best"):
        best = dk["fp8_cuda_best"]
        print(f"decode kernel, CUDA fp8: {best['us']:.1f} us ({best['GBps']:.0f} GB/s, {best['stages']} stages, "
              f"{best['splits']} splits): {dk['bf16']['us'] / best['us']:.2f}x bf16")
    elif dk.get("fp8_cuda_skipped") or dk.get("fp8_cuda_sweep"):
        print(f"decode kernel, CUDA fp8: {dk.get('fp8_cuda_skipped') or 'no correct setting'}")
    blocks = {k: get(f"engine_{k}", "info", "num_blocks") for k in ("bf16", "fp8")}
    if all(blocks.values()):
        print(f"KV blocks at gpu_memory_utilization 0.9: bf16 {blocks['bf16']} vs fp8 {blocks['fp8']} "
              f"({blocks['fp8'] / blocks['bf16']:.2f}x)")
    for tag in [""] + [f"_{i}" for i in range(2, 10) if f"engine_bf16_{i}" in r]:
        names = ["bf16", "fp8", "fp8_cuda"] + sorted({k[len("engine_"):-len(tag) or None] for k in r
                                                      if k.startswith("engine_fp8_cuda_s") and k.endswith(tag)
                                                      and (tag or k[-2] != "_")})
        steps = {k: get(f"engine_{k}{tag}", "decode") for k in names}
        for k, d in steps.items():
            if d:
                share = f", {d['achieved_GBps'] / copy * 100:.0f}% of copy" if copy else ""
                print(f"decode step {k}{tag}: {d['itl_ms']:.2f} ms (device {d['device_only_step_ms']:.2f} ms), "
                      f"{d['bytes_per_step_GB']:.1f} GB/step = {d['achieved_GBps']:.0f} GB/s{share}")
        for k in names[1:]:
            if steps["bf16"] and steps[k]:
                print(f"decode step speedup {k}{tag} vs bf16: {steps['bf16']['itl_ms'] / steps[k]['itl_ms']:.3f}x "
                      f"(device only {steps['bf16']['device_only_step_ms'] / steps[k]['device_only_step_ms']:.3f}x)")
    pp = get("engine_bf16", "prefill_profile_8192")
    if pp and "device_busy_us" in pp:
        print(f"prefill 8192: {pp['wall']['step_s'] * 1e3:.1f} ms ({pp['wall']['tflops']:.0f} TFLOP/s); profiled "
              f"{pp['profiled_step_us'] / 1e3:.1f} ms: device busy {pp['device_busy_us'] / 1e3:.1f} ms, idle in span "
              f"{pp['device_idle_in_span_us'] / 1e3:.2f} ms, before first kernel {pp['before_first_kernel_us'] / 1e3:.2f}"
              f" ms; {list(pp['by_kind_us'].items())[:6]}")
    for k in ("bf16", "fp8"):
        lc = get(f"engine_{k}", "long_context", "backends")
        if lc:
            print(f"32k TTFT {k}: " + ", ".join(f"{b} {v['ttft_s'] * 1e3:.0f} ms" for b, v in lc.items()))
    for row in get("accuracy", "rows", default=[]) or []:
        print(f"accuracy {row['kv_cache_dtype']}: agreement {row['token_agreement']:.4f}, logprob |diff| "
              f"{row['logprob_mad']:.4f}, identical {row['identical_prompts']}/{row['prompts']}, "
              f"answer {row['capital_answer']!r}")
    for sec in ("nixl", "pd1"):
        for k in ("bf16", "fp8", "bf16_scatter", "fp8_scatter"):
            tail = get(sec, k, "tail")
            if tail:
                print(f"{sec} {k}: " + " | ".join(tail[-5:]))


def _interpreter_scalars() -> None:
    """Under TRITON_INTERPRET=1 with numpy 2: the workaround tests/test_gpu_kernels.py applies (scalars held
    as 1-element arrays must convert through their element)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--small runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".out")))
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting sections past this")
    ap.add_argument("--skip", default="", help="comma-separated section names to skip")
    ap.add_argument("--no-long-prompt", action="store_true", help="engines: skip the 32k-prompt TTFT")
    ap.add_argument("--no-small-batches", action="store_true", help="decode_kernel: batch 64 only")
    ap.add_argument("--small", action="store_true", help="CPU dry run with tiny shapes (plumbing only)")
    ap.add_argument("--prefill-profile", action="store_true", help="engine_bf16: profile one 8192-token prefill")
    ap.add_argument("--repeat-engines", type=int, default=1, help="decode steps of the engines N times, alternated")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per engine (median)")
    ap.add_argument("--cuda-stages-also", default="", help="engine_fp8_cuda again at these stage counts (A/B)")
    ap.add_argument("--tokenizer", default=".whl/smol-tok", help="tokenizer folder for the pd1 servers")
    args = ap.parse_args()
    run = Run(Path(args.out), args.budget_s, set(filter(None, args.skip.split(","))))
    small = args.small
    if small:
        _interpreter_scalars()
    else:
        from gpu_suite import env_info

        run.results["env"] = env_info()
        run.section("ceilings", ceilings)
    run.section("kernels", kernels, small)
    dk = run.section("decode_kernel", decode_kernel, small, not args.no_small_batches, True)
    if small:
        for name in ("accuracy", "nixl", "pd1"):
            if name == "accuracy":
                run.section(name, accuracy, True)
            elif name == "nixl":
                run.section(name, nixl, True, 120, run.out)
            else:
                run.section(name, pd1, True, 300, args.tokenizer)
        summarize(run.results)
        return 0
    if dk and dk.get("fp8_best"):
        run.results["fp8_decode_configs_used"] = use_fp8_decode_config(tuple(dk["fp8_best"]["config"]), 64)
    long_prompt = 0 if args.no_long_prompt else 32768
    for i in range(max(1, args.repeat_engines)):
        tag = "" if i == 0 else f"_{i + 1}"
        first = i == 0
        run.section(f"engine_bf16{tag}", engine, "auto", 64, 4096, long_prompt if first else 0,
                    args.prefill_profile and first, args.steps, min_left_s=150)
        run.section(f"engine_fp8{tag}", engine_triton_fp8, 64, 4096, long_prompt if first else 0, min_left_s=120)
        run.section(f"engine_fp8_cuda{tag}", engine_with_cuda_decode, (dk or {}).get("fp8_cuda_best"), 64, 4096,
                    min_left_s=90)
        for st in filter(None, args.cuda_stages_also.split(",")):
            run.section(f"engine_fp8_cuda_s{st}{tag}", engine_with_cuda_decode, (dk or {}).get("fp8_cuda_best"), 64,
                        4096, int(st), min_left_s=60)
    run.section("accuracy", accuracy, False, min_left_s=90)
    run.section("nixl", nixl, False, 60, run.out, min_left_s=50)
    run.section("pd1", pd1, False, max(60.0, run.left() / 2), args.tokenizer, min_left_s=80)
    summarize(run.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
