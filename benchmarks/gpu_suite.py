"""Everything the GPU path must show, in one device call: ceilings, correctness, kernel sweeps, engine
benchmarks. Writes $OUT/gpu_suite.json (all numbers) and $OUT/gpu_suite.md, and prints a short table last.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_suite.py --out $OUT [--offline-prompts 1000] [--budget-s 540]

Ceilings are measured in the same run: bf16 8192^3 torch matmul (TFLOP/s) and a 1 GiB device-to-device
copy. Copy bandwidth is reported two ways: bytes read + bytes written per second (METHOD.md's convention,
what the memory system delivers; the primary ceiling here) and bytes copied per second (half of it).

Benchmarks on Llama-3.1-8B in its real shapes with random weights (`--load-format dummy`), bf16:
- P1 decode, batch 1: weight bytes read per step / ITL vs copy bandwidth (goal >= 85%).
- P2 decode, batch 64, 2k context: (weight + KV bytes read per step) / step time vs copy bandwidth
  (goal >= 75%).
- P3 prefill, 8192 tokens in one step: model FLOPs / time vs matmul TFLOP/s (goal >= 65%).
- Offline throughput: N prompts of 1024 in / 512 out: tokens/s and the CPU's share of step time.
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


class Suite:
    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        (self.out / "gpu_suite.json").write_text(json.dumps(self.results, indent=1, default=str))

    def section(self, name: str, fn, *args, min_left_s: float = 0.0, **kwargs) -> Any:
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

    # ---- prefill: FlashInfer's shape (B=8, q 512 of kv 2048) and P3's (one fresh 8192-token prompt)
    pre_cfgs = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4)]  # (block_m, tile_n, warps, stages)
    shapes = {"b8_q512_kv2048": ([512] * 8, [2048] * 8), "1x8192_fresh": ([8192], [8192])}
    cases = {name: make_paged_case(q, s, h, kvh, d, num_layers=8, seed=3) for name, (q, s) in shapes.items()}
    for name, c in cases.items():
        q_lens, s_lens = shapes[name]
        flops = _attention_flops(h, d, q_lens, s_lens)
        for block_m, tile_n, warps, stages in pre_cfgs:
            def fn(c=c, q_lens=q_lens, block_m=block_m, tile_n=tile_n, warps=warps, stages=stages):
                tk.prefill_attention(c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.seq_lens,
                                     c.meta.query_start_loc, d**-0.5, len(q_lens), block_m=block_m, tile_n=tile_n,
                                     num_warps=warps, num_stages=stages)
            row = {"shape": name, "block_m": block_m, "tile_n": tile_n, "warps": warps, "stages": stages}
            try:
                us = bench_us(fn)
                row.update(us=us, tflops=flops / us / 1e6)
            except Exception as e:  # noqa: BLE001
                row["error"] = str(e)[:200]
            res["prefill"].append(row)
    ok_rows = [r for r in res["prefill"] if "us" in r]
    # pick the config with the best geometric mean over the two shapes
    by_cfg: dict[tuple, list[float]] = {}
    for r in ok_rows:
        by_cfg.setdefault((r["block_m"], r["tile_n"], r["warps"], r["stages"]), []).append(r["tflops"])
    best_pre = max((k for k, v in by_cfg.items() if len(v) == 2), key=lambda k: by_cfg[k][0] * by_cfg[k][1])
    res["prefill_best_config"] = dict(zip(("block_m", "tile_n", "warps", "stages"), best_pre, strict=True))
    res["prefill_b8_q512_kv2048_best_tflops"] = max(r["tflops"] for r in ok_rows if r["shape"] == "b8_q512_kv2048")
    res["prefill_1x8192_best_tflops"] = max(r["tflops"] for r in ok_rows if r["shape"] == "1x8192_fresh")
    res["prefill_flashinfer_sm90_tflops"] = FLASHINFER_H200["prefill_b8_q512_kv2048_tflops_sm90"]
    # torch SDPA (flash) on contiguous, non-paged K/V for the fresh 8192 prompt: a point of comparison
    with contextlib.suppress(Exception):
        q = torch.randn((1, h, 8192, d), device="cuda", dtype=torch.bfloat16)
        k = torch.randn((1, h, 8192, d), device="cuda", dtype=torch.bfloat16)
        v = torch.randn((1, h, 8192, d), device="cuda", dtype=torch.bfloat16)
        us = bench_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        res["sdpa_contiguous_1x8192_tflops"] = _attention_flops(h, d, [8192], [8192]) / us / 1e6
    # apply the winners to the backend for the engine sections of this run
    tb.DECODE_CONFIGS = decode_table
    tb.PREFILL_BLOCK_M, tb.PREFILL_TILE_N, tb.PREFILL_WARPS, tb.PREFILL_STAGES = best_pre
    return res


# ---------------------------------------------------------------------------------------------------
# engine benchmarks
# ---------------------------------------------------------------------------------------------------
class EngineBench:
    def __init__(self, max_model_len: int = 10240, max_num_seqs: int = 256):
        from pdserve.config import EngineConfig
        from pdserve.engine.engine import LLMEngine
        from pdserve.gpu.model_configs import dummy_model_dir

        self.model_name = "Llama-3.1-8B"
        t0 = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(
            model=str(dummy_model_dir(self.model_name)), load_format="dummy", dtype="bfloat16",
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
            gpu_memory_utilization=0.9,  # prefix caching on, as served (random prompts never hit)
        ))
        torch.cuda.synchronize()
        self.init_s = time.perf_counter() - t0
        runner = self.engine.runner
        self.cfg = runner.model_cfg
        model = runner.model
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.embed_tokens.weight
        # a decode step reads every weight once, except the embedding table (one row per token)
        self.weight_bytes_per_step = self.param_bytes - embed.numel() * embed.element_size()
        c = self.cfg
        self.kv_bytes_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
        layer = model.layers[0]
        per_layer = sum(m.weight.numel() for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj))
        self.linear_params = per_layer * c.num_layers
        free, total = torch.cuda.mem_get_info()
        self.info = {
            "model": self.model_name, "init_s": round(self.init_s, 1), "param_GB": self.param_bytes / 1e9,
            "weight_bytes_per_decode_step_GB": self.weight_bytes_per_step / 1e9,
            "num_blocks": runner.num_blocks, "kv_pool_GB": runner.kv_pool.numel() * 2 / 1e9,
            "kv_tokens": runner.num_blocks * runner.block_size,
            "graph_sizes": runner.gpu.graph_sizes, "gpu_free_after_init_GB": free / 1e9,
            "gpu_total_GB": total / 1e9, "max_allocated_GB": torch.cuda.max_memory_allocated() / 1e9,
        }
        self.counter = 0
        self.gen = torch.Generator().manual_seed(1234)

    def prompts(self, n: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.cfg.vocab_size, (n, length), generator=self.gen).tolist()

    def add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from pdserve.engine.sampling_params import SamplingParams

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

    def decode(self, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
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
        breakdown = self.kernel_breakdown(size)
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
        top = sorted(kinds.items(), key=lambda kv: -kv[1])[:14]
        return {"device_us_per_step": total, "kernels_per_step": sum(count.values()),
                "top": [{"kernel": k[:90], "us": round(v, 1), "calls": count[k]} for k, v in top]}

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


# ---------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".out")))
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting sections past this")
    ap.add_argument("--offline-prompts", type=int, default=1000)
    ap.add_argument("--skip", default="", help="comma-separated section names to skip")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    s = Suite(Path(args.out), args.budget_s)
    s.results["flashinfer_h200_reference"] = FLASHINFER_H200
    s.section("env", env_info)
    ceil = s.section("ceilings", ceilings) or {}
    # the 8B logits check needs ~50 GB: before the engine takes 90% of the GPU for its KV pool
    for name, fn in (("correctness_kernels", correctness_kernels), ("kernel_sweeps", kernel_sweeps),
                     ("correctness_8b", correctness_8b), ("correctness_engines", correctness_engines)):
        if name not in skip:
            s.section(name, fn, min_left_s=60)
    holder: dict[str, EngineBench] = {}

    def engine_init() -> dict[str, Any]:
        holder["bench"] = EngineBench()  # kept across the sections below; the section records its info
        return holder["bench"].info

    if "engine" not in skip:
        s.section("engine_init", engine_init, min_left_s=60)
    eb = holder.get("bench")
    if eb is not None:
        s.section("p1_decode_b1", eb.decode, 1, 128, 200, min_left_s=20)
        s.section("decode_b1_variants", eb.decode_variants_b1, min_left_s=20)
        s.section("p2_decode_b64_2k", eb.decode, 64, 2048, 64, min_left_s=30)
        s.section("p2_no_prefix_cache", eb.decode_no_prefix_cache, 64, 2048, 32, min_left_s=30)
        s.section("host_profile_b256", eb.host_profile, 256, 1024, 20, min_left_s=40)
        s.section("p3_prefill_1x8192", eb.prefill, 1, 8192, min_left_s=15)
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
                     f"FlashInfer {FLASHINFER_H200['decode_b8_kv2048_us']} us", ""))
        rows.append(("prefill kernel b8 q512/2048", f"{ks['prefill_b8_q512_kv2048_best_tflops']:.0f} TFLOP/s",
                     f"FlashInfer sm90 {FLASHINFER_H200['prefill_b8_q512_kv2048_tflops_sm90']:.0f}", ""))
        rows.append(("prefill kernel 1x8192", f"{ks['prefill_1x8192_best_tflops']:.0f} TFLOP/s",
                     f"SDPA contiguous {ks.get('sdpa_contiguous_1x8192_tflops', 0):.0f}", ""))
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
