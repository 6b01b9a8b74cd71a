"""GPU correctness checks, run on the GPU machine (benchmarks/gpu_suite.py calls them; also runnable alone:
`python -m pdserve.testing.gpu_correctness`).

1. Kernels vs a float32 SDPA reference on random paged inputs (relative error), incl. chunked prefill,
   prefix context, decode rows in mixed steps, GQA groups of 4 and 7, padding rows, every split count.
2. Engines: greedy tokens of the GPU engine (Triton, fused ops, CUDA graphs) == the CPU engine (torch
   SDPA backend) == HF transformers, on tiny float32 random models, with chunked prefill and prefix hits.
3. Llama-3.1-8B shape (dummy weights, all 32 layers), bf16: the fused Triton path vs the torch-ops +
   SDPA reference path, both measured against that reference in float32, for a prefill and a few decode
   steps.

The random paged cases and the SDPA reference live in pdserve/attention/paged_reference.py (the fp8 decode
kernel's self-check uses them when serving); they need no GPU and also serve the CPU tests, which run the
kernels under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.paged_reference import PagedCase, SdpaReference, fp8_case, make_paged_case, rel_err

# ---------------------------------------------------------------------------------------------------
# 1. kernels
# ---------------------------------------------------------------------------------------------------
KERNEL_CASES: list[dict[str, Any]] = [
    # name, query lens, seq lens, heads, kv heads, head dim
    {"name": "prefill-fresh-mixed", "q": [1, 17, 130, 300], "s": [1, 17, 130, 300], "h": 32, "kvh": 8, "d": 128},
    {"name": "prefill-chunked+prefix", "q": [64, 200, 33], "s": [600, 1000, 33], "h": 32, "kvh": 8, "d": 128},
    {"name": "mixed-decode-rows", "q": [1, 1, 96, 1], "s": [50, 700, 96, 2049], "h": 32, "kvh": 8, "d": 128},
    {"name": "prefill-gqa7-qwen", "q": [77, 160], "s": [77, 400], "h": 28, "kvh": 4, "d": 128},
    {"name": "decode-b8-2k", "q": [1] * 8, "s": [2048] * 8, "h": 32, "kvh": 8, "d": 128},
    {"name": "decode-ragged", "q": [1] * 5, "s": [1, 15, 16, 17, 3000], "h": 32, "kvh": 8, "d": 128},
    {"name": "decode-gqa7-qwen", "q": [1] * 3, "s": [5, 600, 1500], "h": 28, "kvh": 4, "d": 128},
    {"name": "prefill-d64", "q": [40, 90], "s": [100, 90], "h": 8, "kvh": 2, "d": 64},
]


def check_kernels(dtype: torch.dtype = torch.bfloat16, device: str = "cuda", tol: float | None = None,
                  cases: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each attention kernel vs SDPA in float32 on the same (bf16-rounded) inputs."""
    from pdserve.attention import triton_kernels as tk

    tol = tol if tol is not None else (2e-2 if dtype == torch.bfloat16 else 1e-5)
    results: list[dict[str, Any]] = []
    ref = SdpaReference(torch.float32)
    for n, case in enumerate(cases or KERNEL_CASES):
        c = make_paged_case(case["q"], case["s"], case["h"], case["kvh"], case["d"], dtype=dtype, device=device,
                            seed=100 + n)
        scale = case["d"] ** -0.5
        want = ref.forward(c.q, c.k_cache, c.v_cache, c.meta, scale).float()
        if c.meta.decode_only:
            counters = tk.new_merge_counters(c.q.device, 4096)
            for splits in sorted({1, 2, 3, 7, 16, 32, tk.decode_num_splits(len(case["q"]), case["kvh"], 132)}):
                for fused in (False, True) if splits > 1 else (False,):
                    for _ in range(2 if fused else 1):  # twice: the counters must be back at rest
                        out = torch.full_like(c.q, float("nan"))  # poisoned: every element must be written
                        tk.decode_attention(c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.seq_lens, scale,
                                            splits, out=out, merge_counters=counters if fused else None)
                    err = rel_err(out, want)
                    results.append({"kernel": "decode" + ("+fused-merge" if fused else ""), "case": case["name"],
                                    "splits": splits, "rel_err": err,
                                    "ok": err < tol and not bool(counters.any())})
        out = torch.full_like(c.q, float("nan"))
        tk.prefill_attention(c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.seq_lens,
                             c.meta.query_start_loc, scale, len(case["q"]), out=out)
        err = rel_err(out, want)
        results.append({"kernel": "prefill", "case": case["name"], "rel_err": err, "ok": err < tol})

    # write_kv into the strided pool view must equal index_put exactly, and skip slot -1
    c = make_paged_case([5, 9], [20, 9], 8, 4, 128, dtype=dtype, device=device, seed=7)
    t = c.q.shape[0]
    k = torch.randn((t, 4, 128), device=device).to(dtype)
    v = torch.randn((t, 4, 128), device=device).to(dtype)
    slots = c.meta.slot_mapping.clone()
    slots[1] = -1
    want_pool = c.pool.clone()
    keep = slots >= 0
    blk = torch.div(slots[keep], 16, rounding_mode="floor")
    want_pool[:, c.layer, 0][blk, slots[keep] % 16] = k[keep]
    want_pool[:, c.layer, 1][blk, slots[keep] % 16] = v[keep]
    tk.write_kv(c.k_cache, c.v_cache, k, v, slots, 16)
    results.append({"kernel": "write_kv", "case": "strided-pool+padding-slot", "ok": bool(torch.equal(c.pool, want_pool))})
    return results


def check_ops(dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> list[dict[str, Any]]:
    """Fused elementwise kernels vs the decoder's torch ops (same rounding points)."""
    from pdserve.engine.runner import gpu_ops as ops
    from pdserve.model.decoder import RMSNorm
    from pdserve.model.rope import apply_rotary

    tol = 1e-2 if dtype != torch.float32 else 1e-6
    gen = torch.Generator().manual_seed(3)
    res: list[dict[str, Any]] = []
    t, hidden = 37, 4096
    x = torch.randn((t, hidden), generator=gen).to(dtype=dtype, device=device)
    r = torch.randn((t, hidden), generator=gen).to(dtype=dtype, device=device)
    norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    with torch.inference_mode():
        want = norm(x)
        res.append({"op": "rms_norm", "rel_err": rel_err(ops.rms_norm(x, norm.weight, 1e-5), want)})
        h = r + x
        want = norm(h)
        got, new_r = ops.fused_add_rms_norm(x, r.clone(), norm.weight, 1e-5)
        res.append({"op": "fused_add_rms_norm", "rel_err": max(rel_err(got, want), rel_err(new_r, h))})
        gu = torch.randn((t, 2 * 1000), generator=gen).to(dtype=dtype, device=device)
        want = F.silu(gu[:, :1000]) * gu[:, 1000:]
        res.append({"op": "silu_and_mul", "rel_err": rel_err(ops.silu_and_mul(gu), want)})
        # RoPE + K/V store, q/k/v as strided views of one qkv tensor
        heads, kvh, d = 28, 4, 128
        qkv = torch.randn((t, (heads + 2 * kvh) * d), generator=gen).to(dtype=dtype, device=device)
        q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(t, heads, d), k.view(t, kvh, d), v.view(t, kvh, d)
        pos = torch.randint(0, 100_000, (t,), generator=gen).to(device)
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
        freqs = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        c = make_paged_case([t], [t], heads, kvh, d, dtype=dtype, device=device, seed=9)
        q_out = ops.rope_and_write_kv(q, k, v, cos, sin, c.k_cache, c.v_cache, c.meta.slot_mapping, 16)
        want_q = apply_rotary(q, cos, sin)
        want_k = apply_rotary(k, cos, sin)
        table = c.meta.block_tables[0].long()
        got_k = c.k_cache[table].flatten(0, 1)[:t]
        got_v = c.v_cache[table].flatten(0, 1)[:t]
        err = max(rel_err(q_out, want_q), rel_err(got_k, want_k), rel_err(got_v, v))
        res.append({"op": "rope_and_write_kv", "rel_err": err})
        # the batch-1 GEMV: even and ragged K, with and without bias, the long-K configuration
        for n_out, k_in, bias in ((300, 256, False), (70, 200, True), (40, 9000, False)):
            w = torch.randn((n_out, k_in), generator=gen).to(dtype=dtype, device=device)
            xb = torch.randn((1, k_in), generator=gen).to(dtype=dtype, device=device)
            b = torch.randn(n_out, generator=gen).to(dtype=dtype, device=device) if bias else None
            want = F.linear(xb.double(), w.double(), None if b is None else b.double())
            res.append({"op": f"linear[{n_out}x{k_in}{'+b' if bias else ''}]",
                        "rel_err": rel_err(ops.gemv(xb, w, b), want)})
        res += _check_gemv_epilogues(ops, dtype, device, gen)
    for item in res:
        item["ok"] = item["rel_err"] < tol
    return res


def _check_gemv_epilogues(ops, dtype: torch.dtype, device: str, gen: torch.Generator) -> list[dict[str, Any]]:
    """The batch-1 GEMVs with fused epilogues (pdserve.engine.runner.gemv) vs the unfused ops they replace."""
    from torch import nn

    from pdserve.engine.runner import gemv as gv

    def linear(k_in: int, n_out: int, bias: bool) -> nn.Linear:
        layer = nn.Linear(k_in, n_out, bias=bias)
        with torch.no_grad():
            layer.weight.copy_(torch.randn((n_out, k_in), generator=gen) / k_in**0.5)
            if bias:
                layer.bias.copy_(torch.randn(n_out, generator=gen))
        return layer.to(device=device, dtype=dtype)

    saved = gv.EPILOGUE_FUSIONS, gv.NORM_EPILOGUE
    gv.EPILOGUE_FUSIONS = gv.NORM_EPILOGUE = True  # (the switches the engine reads; checked here whatever they say)
    try:
        return _check_gemv_epilogues_on(ops, gv, linear, dtype, device, gen)
    finally:
        gv.EPILOGUE_FUSIONS, gv.NORM_EPILOGUE = saved


def _check_gemv_epilogues_on(ops, gv, linear, dtype: torch.dtype, device: str,
                             gen: torch.Generator) -> list[dict[str, Any]]:
    from pdserve.model.rope import apply_rotary

    res: list[dict[str, Any]] = []
    # gate_up + SiLU-and-mul: an intermediate size that is no multiple of the pairs per program, ragged K
    for inter, k_in, bias in ((998, 256, False), (64, 200, True)):
        layer = linear(k_in, 2 * inter, bias)
        x = torch.randn((1, k_in), generator=gen).to(dtype=dtype, device=device)
        want = ops.silu_and_mul(ops.gemv(x, layer.weight, layer.bias))
        res.append({"op": f"gate_up_silu[{inter}x{k_in}{'+b' if bias else ''}]",
                    "rel_err": rel_err(gv.gate_up_silu(x, layer), want)})
    # qkv + RoPE + K/V store: the token's slot, and a padding row's slot -1 (nothing stored)
    heads, kvh, d, k_in = 28, 4, 128, 256
    layer = linear(k_in, (heads + 2 * kvh) * d, True)
    x = torch.randn((1, k_in), generator=gen).to(dtype=dtype, device=device)
    pos = torch.tensor([12345], device=device)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
    emb = torch.cat((pos.float()[:, None] * inv[None, :],) * 2, -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    c = make_paged_case([1], [40], heads, kvh, d, dtype=dtype, device=device, seed=11)
    qkv = ops.gemv(x, layer.weight, layer.bias)
    q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    want_q = apply_rotary(q.view(1, heads, d), cos, sin)
    want_k = apply_rotary(k.view(1, kvh, d), cos, sin)
    before = c.pool.clone()
    got_q = gv.qkv_rope_and_write_kv(x, layer, heads, kvh, d, cos, sin, c.k_cache, c.v_cache, c.meta.slot_mapping, 16)
    slot = int(c.meta.slot_mapping[0])
    blk = slot // 16  # slots are physical: block id * block size + offset
    got_k = c.k_cache[blk, slot % 16]
    got_v = c.v_cache[blk, slot % 16]
    untouched = before.clone()
    untouched[:, c.layer, 0][blk, slot % 16] = c.pool[:, c.layer, 0][blk, slot % 16]
    untouched[:, c.layer, 1][blk, slot % 16] = c.pool[:, c.layer, 1][blk, slot % 16]
    err = max(rel_err(got_q, want_q), rel_err(got_k, want_k[0]), rel_err(got_v, v.view(kvh, d)))
    res.append({"op": "qkv_rope_and_write_kv", "rel_err": err if torch.equal(untouched, c.pool) else float("inf")})
    pad = torch.full_like(c.meta.slot_mapping, -1)
    before = c.pool.clone()
    gv.qkv_rope_and_write_kv(x, layer, heads, kvh, d, cos, sin, c.k_cache, c.v_cache, pad, 16)
    res.append({"op": "qkv_rope_and_write_kv[slot -1]", "rel_err": 0.0 if torch.equal(before, c.pool) else float("inf")})
    # LM head + argmax: the token is its own logits' first argmax, ties included; the scratch ends at rest
    vocab, k_in = 4000, 96
    layer = linear(k_in, vocab, False)
    x = torch.randn((1, k_in), generator=gen).to(dtype=dtype, device=device)
    scratch = gv.new_epilogue_scratch(torch.device(device))
    for tie in (None, (2500, 700, 3999)):
        if tie is not None:  # three equal best rows: the lowest index must win
            with torch.no_grad():
                for r in tie:
                    layer.weight[r] = x[0] * 4
        want = ops.gemv(x, layer.weight).float()
        for _ in range(2):
            logits, token = gv.lm_head_argmax(x, layer, scratch[0:2])
        ok = (int(token[0]) == int(want.argmax(-1)[0]) == int(logits.argmax(-1)[0])
              and (tie is None or int(token[0]) == min(tie))
              and scratch.tolist() == [gv.ARGMAX_KEY_RESET, 0, 0])
        res.append({"op": f"lm_head_argmax{'[ties]' if tie else ''}",
                    "rel_err": rel_err(logits, want) if ok else float("inf")})
    # o_proj / down_proj + residual add + RMSNorm in the last program (run twice: the counter at rest)
    for n_out, k_in, bias in ((4096, 512, False), (300, 200, True)):
        layer = linear(k_in, n_out, bias)
        x = torch.randn((1, k_in), generator=gen).to(dtype=dtype, device=device)
        res0 = torch.randn((1, n_out), generator=gen).to(dtype=dtype, device=device)
        nw = (1 + 0.1 * torch.randn(n_out, generator=gen)).to(dtype=dtype, device=device)
        want_h, want_r = ops.fused_add_rms_norm(ops.gemv(x, layer.weight, layer.bias), res0.clone(), nw, 1e-5)
        errs = []
        for _ in range(2):
            got_h, got_r = gv.linear_add_rms_norm(x, layer, res0.clone(), nw, 1e-5, scratch[2:3])
            errs.append(max(rel_err(got_h, want_h), rel_err(got_r, want_r)))
        res.append({"op": f"linear_add_rms_norm[{n_out}x{k_in}{'+b' if bias else ''}]",
                    "rel_err": max(errs) if int(scratch[2]) == 0 else float("inf")})
    return res


def _check_cuda_fp8_decode(c8: PagedCase, fmt: Any, scale: float, want: torch.Tensor, splits_list: tuple[int, ...],
                           tol: float, case_name: str) -> list[dict[str, Any]]:
    """The CUDA fp8 decode kernel (pdserve.attention.cuda_fp8_decode) on a decode case it takes, every stage count,
    unless PDSERVE_FP8_DECODE=triton; nothing where it cannot run (CPU, another head size, no nvcc, a GPU before
    sm_89); a failed build or self-check on a machine with nvcc is a failed row."""
    from pdserve.attention import cuda_fp8_decode as cfd

    if not cfd.selected():
        return []
    if not cfd.usable(c8.q, c8.k_cache, fmt):
        error = cfd.build_error(c8.q.device) if c8.q.is_cuda else None
        if error is None or "nvcc not found" in error:
            return []  # a shape it does not take, or a machine that cannot build it
        return [{"kernel": f"decode-cuda[{fmt.name}]", "case": case_name, "ok": False, "error": error[-500:]}]
    rows = []
    for stages in cfd.STAGES:
        for splits in splits_list:
            out = torch.full_like(c8.q, float("nan"))
            cfd.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens, scale, splits,
                                 fmt, stages=stages, out=out)
            err = rel_err(out, want)
            rows.append({"kernel": f"decode-cuda[{fmt.name}]", "case": case_name, "stages": stages,
                         "splits": splits, "rel_err": err, "ok": err < tol})
    return rows


def check_fp8_kernels(dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                      cases: list[dict[str, Any]] | None = None, formats: tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2"),
                      block_size: int = 16, tile_n: int | None = None, block_m: int | None = None,
                      splits_list: tuple[int, ...] = (1, 3, 16)) -> list[dict[str, Any]]:
    """The kernels over an fp8 pool: attention vs SDPA in float32 over the dequantized pool (decode with several
    splits; decode or prefill again with stale bytes past the sequences' ends); the K/V
    stores (plain, and fused with RoPE) byte-for-byte vs fp8_kv.write (the CPU writer) of the rows they store into a
    float pool (the fused RoPE's own rounding is check_ops' business), padding slots skipped."""
    from pdserve.attention import fp8_kv
    from pdserve.attention import triton_kernels as tk
    from pdserve.engine.runner import gpu_ops as ops

    tol = 1e-5 if dtype == torch.float32 else 2e-2  # 16-bit queries: the products run in 16 bits
    ref = SdpaReference(torch.float32)
    sizes = {} if tile_n is None else {"tile_n": tile_n}
    results: list[dict[str, Any]] = []
    for name in formats:
        fmt = fp8_kv.fp8_format(name)
        for n, case in enumerate(cases or KERNEL_CASES):
            c8, cf = fp8_case(make_paged_case(case["q"], case["s"], case["h"], case["kvh"], case["d"], dtype=dtype,
                                              device=device, seed=200 + n, block_size=block_size), name)
            scale = case["d"] ** -0.5
            want = ref.forward(cf.q, cf.k_cache, cf.v_cache, cf.meta, scale).float()
            if c8.meta.decode_only:
                for splits in splits_list:
                    out = torch.full_like(c8.q, float("nan"))
                    tk.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens, scale,
                                        splits, out=out, kv_format=fmt, **sizes)
                    err = rel_err(out, want)
                    results.append({"kernel": f"decode[{name}]", "case": case["name"], "splits": splits,
                                    "rel_err": err, "ok": err < tol})
                results += _check_cuda_fp8_decode(c8, fmt, scale, want, splits_list, tol, case["name"])
            out = torch.full_like(c8.q, float("nan"))
            extra = sizes if block_m is None else {**sizes, "block_m": block_m}
            tk.prefill_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens,
                                 c8.meta.query_start_loc, scale, len(case["q"]), out=out, kv_format=fmt, **extra)
            err = rel_err(out, want)
            results.append({"kernel": f"prefill[{name}]", "case": case["name"], "rel_err": err, "ok": err < tol})
            # V bytes past each sequence's end (read with the whole rows of its last block) set to stale data,
            # the format's largest code: results unchanged (their probabilities are 0)
            values, _ = fp8_kv.layer_views(c8.v_cache, is_v=True)
            bs = c8.meta.block_size
            for b, n in enumerate(case["s"]):
                values[int(c8.meta.block_tables[b, (n - 1) // bs]), :, (n - 1) % bs + 1:] = 0x7E if fmt.name == "fp8_e4m3" else 0x7B
            out = torch.full_like(c8.q, float("nan"))
            if c8.meta.decode_only:
                tk.decode_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens, scale, 3,
                                    out=out, kv_format=fmt, **sizes)
                results += _check_cuda_fp8_decode(c8, fmt, scale, want, (3,), tol,
                                                  case["name"] + ", stale bytes past the end")
            else:
                tk.prefill_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens,
                                     c8.meta.query_start_loc, scale, len(case["q"]), out=out, kv_format=fmt, **extra)
            err = rel_err(out, want)
            results.append({"kernel": f"{'decode' if c8.meta.decode_only else 'prefill'}[{name}]",
                            "case": case["name"] + ", stale bytes past the end", "rel_err": err, "ok": err < tol})

        # the stores: same bytes as the CPU path's fp8_kv.write, slot -1 skipped, nothing else touched
        gen = torch.Generator().manual_seed(11)
        heads, kvh, d, t = 8, 4, 64, 14
        cfloat = make_paged_case([t], [t + 3], heads, kvh, d, dtype=dtype, device=device, seed=12,
                                 block_size=block_size)
        c8, _ = fp8_case(cfloat, name)
        qkv = torch.randn((t, (heads + 2 * kvh) * d), generator=gen)
        qkv = (qkv * torch.exp(2 * torch.randn((t, 1), generator=gen))).to(dtype=dtype, device=device)
        q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(t, heads, d), k.view(t, kvh, d), v.view(t, kvh, d)
        slots = c8.meta.slot_mapping.clone()
        slots[1] = -1
        keep = slots >= 0
        blk = torch.div(slots[keep], block_size, rounding_mode="floor")
        emb = torch.randn((t, d // 2), generator=gen).to(device)
        cos, sin = torch.cat((emb, emb), -1).cos().to(dtype), torch.cat((emb, emb), -1).sin().to(dtype)
        # a checkpoint's static per-tensor scales (bfloat16 values): small enough that the largest rows clamp
        static = (fp8_kv.static_kv_scale(float(k.abs().max()) / fmt.max / 4),
                  fp8_kv.static_kv_scale(float(v.abs().max()) / fmt.max / 4))
        for op, kv_scale in itertools.product(("write_kv", "rope_and_write_kv"), (None, static)):
            k_static, v_static = kv_scale if kv_scale is not None else (None, None)
            pool = c8.pool.clone()
            kc, vc = pool[:, c8.layer, 0], pool[:, c8.layer, 1]
            want_pool = c8.pool.clone()
            k_rows = k[keep]
            if op == "rope_and_write_kv":  # the rows the float kernel stores
                fpool = cfloat.pool.clone()
                ops.rope_and_write_kv(q, k, v, cos, sin, fpool[:, c8.layer, 0], fpool[:, c8.layer, 1], slots,
                                      block_size)
                k_rows = fpool[:, c8.layer, 0][blk, slots[keep] % block_size]
            fp8_kv.write(want_pool[:, c8.layer, 0], k_rows, slots[keep], block_size, fmt, k_static, is_v=False)
            fp8_kv.write(want_pool[:, c8.layer, 1], v[keep], slots[keep], block_size, fmt, v_static, is_v=True)
            if op == "write_kv":
                tk.write_kv(kc, vc, k, v, slots, block_size, fmt, kv_scale)
            else:
                ops.Fp8KvOps(fmt).rope_and_write_kv(q, k, v, cos, sin, kc, vc, slots, block_size, kv_scale)
            diff = int((pool != want_pool).sum())
            results.append({"kernel": f"{op}[{name}]", "case": "bytes vs fp8_kv.write"
                            + (" (static scales)" if kv_scale is not None else ""), "bytes_differing": diff,
                            "ok": diff == 0})
    return results


# ---------------------------------------------------------------------------------------------------
# 2. engines on tiny float32 models
# ---------------------------------------------------------------------------------------------------
def _run_engine(engine, prompts: list[list[int]], params) -> list[list[int]]:
    base = engine.num_finished
    ids = [f"c{base}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    return [outs[rid] for rid in ids]


def _hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            # eos_token_id=None: like the engine's ignore_eos, EOS may be generated and does not stop
            # (min_new_tokens would instead forbid EOS, a different distribution)
            gen = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            outs.append(gen[0, len(p) :].tolist())
    return outs


def check_engines_tiny(archs: tuple[str, ...] = ("llama", "qwen2", "qwen3"), max_tokens: int = 24,
                       device: str = "cuda") -> list[dict[str, Any]]:
    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig
    from pdserve.types.sampling_params import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny_models import make_tiny_model  # the tests' builder: save_pretrained, no download

    results: list[dict[str, Any]] = []
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for arch in archs:
        t0 = time.perf_counter()
        model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch)
        gen = torch.Generator().manual_seed(11)
        shared = torch.randint(3, 320, (150,), generator=gen).tolist()
        wave1 = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (1, 7, 16, 33, 100, 257)] + [shared]
        # wave 2 runs after wave 1 finished: prefix-cache hits on `shared` (full blocks), plus new prompts
        wave2 = [shared[:64] + [5, 6, 7], shared[:150], shared[:48]] + [
            torch.randint(3, 320, (n,), generator=gen).tolist() for n in (3, 90)
        ]
        # alone: every decode step a batch-1 graph step (the GEMV epilogues, the fused split merge)
        solo = [torch.randint(3, 320, (70,), generator=gen).tolist()]
        common = dict(model=str(model_dir), dtype="float32", max_num_batched_tokens=64, num_gpu_blocks_override=256,
                      max_num_seqs=8, max_model_len=1024)
        outs: dict[str, list[list[int]]] = {}
        hits: dict[str, int] = {}
        gpu_info: dict[str, Any] = {}
        # the GPU engine with async scheduling on (launching decode steps ahead) and off
        for name, dev, async_on in (("cpu", "cpu", False), (device, device, True), ("sync", device, False)):
            eng = LLMEngine(EngineConfig(device=dev, async_scheduling=async_on, **common))
            outs[name] = _run_engine(eng, wave1, greedy) + _run_engine(eng, wave2, greedy) + _run_engine(eng, solo, greedy)
            hits[name] = eng.stats().prefix_cache_hits
            if name == device:
                gpu_info = {"backend": eng.runner.backend.name, "graphs": eng.runner.gpu.graph_sizes,
                            "graph_steps": eng.runner.step_timing.graph_steps, "steps": eng.runner.step_timing.steps,
                            "launched_ahead": eng.pipeline.num_launched_ahead if eng.pipeline else 0}
                if arch == archs[0]:
                    gpu_info["async_stops"] = _check_async_stops(eng, outs["cpu"][: len(wave1)], wave1)
            del eng
        hf = _hf_greedy(model_dir, wave1 + wave2 + solo, max_tokens)
        n_prompts = len(hf)
        gpu_vs_cpu = sum(a == b for a, b in zip(outs[device], outs["cpu"], strict=True))
        gpu_vs_hf = sum(a == b for a, b in zip(outs[device], hf, strict=True))
        sync_vs_hf = sum(a == b for a, b in zip(outs["sync"], hf, strict=True))
        stops_ok = gpu_info.get("async_stops", {}).get("ok", True)
        results.append({
            "arch": arch, "prompts": n_prompts, "gpu_eq_cpu": gpu_vs_cpu, "gpu_eq_hf": gpu_vs_hf,
            "gpu_sync_eq_hf": sync_vs_hf, "cpu_eq_hf": sum(a == b for a, b in zip(outs["cpu"], hf, strict=True)),
            "prefix_hit_tokens": hits, **gpu_info,
            "ok": gpu_vs_cpu == n_prompts and gpu_vs_hf == n_prompts and sync_vs_hf == n_prompts
            and hits[device] > 0 and gpu_info.get("launched_ahead", 0) > 0 and stops_ok,
            "seconds": round(time.perf_counter() - t0, 1),
        })
        torch.cuda.empty_cache()
    return results


def _check_async_stops(eng, ref: list[list[int]], prompts: list[list[int]]) -> dict[str, Any]:
    """Async scheduling's stops on the device: per prompt a stop token (taken from its reference tokens),
    EOS, max_tokens or nothing, in one batch; each must end at the same token as the reference, with no
    output after its last, and the pool must be whole again afterwards."""
    from pdserve.types.sampling_params import SamplingParams

    plist = []
    want = []
    for i, r in enumerate(ref):
        k = 2 + i % 5
        if i % 3 == 0:
            plist.append(SamplingParams(max_tokens=len(r), temperature=0.0, ignore_eos=True,
                                        stop_token_ids=[r[k]]))
            want.append(r[: r.index(r[k]) + 1])
        elif i % 3 == 1:
            plist.append(SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
            want.append(r[:k])
        else:
            plist.append(SamplingParams(max_tokens=len(r), temperature=0.0, ignore_eos=True))
            want.append(r)
    base = eng.num_finished
    ids = [f"s{base}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, plist, strict=True):
        eng.add_request(rid, p, sp)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    ended: set[str] = set()
    late = 0
    ahead0 = eng.pipeline.num_launched_ahead if eng.pipeline else 0
    for _ in range(10_000):  # bounded
        if not eng.has_unfinished():
            break
        for o in eng.step():
            late += o.request_id in ended
            got[o.request_id].extend(o.new_token_ids)
            if o.finished:
                ended.add(o.request_id)
    equal = sum(got[rid] == w for rid, w in zip(ids, want, strict=True))
    pool_whole = eng.blocks.num_free_blocks == eng.blocks.num_blocks
    ahead = (eng.pipeline.num_launched_ahead if eng.pipeline else 0) - ahead0
    return {"prompts": len(ids), "equal": equal, "outputs_after_finish": late, "pool_whole": pool_whole,
            "launched_ahead": ahead, "ok": equal == len(ids) and late == 0 and pool_whole and ahead > 0}


# ---------------------------------------------------------------------------------------------------
# 3. 8B shape, bf16 logits
# ---------------------------------------------------------------------------------------------------
def _meta_for(seqs: list[tuple[list[int], int]], tables: list[list[int]], block_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """seqs: (all tokens so far, number already in the cache). Returns ids, positions, meta, last rows."""
    ids, pos, slots, qlens, seqlens = [], [], [], [], []
    for (toks, cached), table in zip(seqs, tables, strict=True):
        for j in range(cached, len(toks)):
            ids.append(toks[j])
            pos.append(j)
            slots.append(table[j // block_size] * block_size + j % block_size)
        qlens.append(len(toks) - cached)
        seqlens.append(len(toks))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    meta = AttentionMetadata.from_host(qlens, seqlens, bt, slots, block_size, device)
    rows = torch.tensor([x - 1 for x in itertools.accumulate(qlens)], device=device)
    return torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta, rows


def check_8b_logits(config_name: str = "Llama-3.1-8B", decode_steps: int = 4, num_layers: int | None = None,
                    seed: int = 0, device: str = "cuda") -> dict[str, Any]:
    """Logits of the fused Triton path (bf16) and of the torch-ops + SDPA path (bf16), each against the
    torch-ops + SDPA path in float32 on the same weights. Pass: the Triton path's error is within
    1.5x the bf16 reference's own error (+1e-3)."""
    from pdserve.attention.triton_backend import TritonAttention
    from pdserve.engine.runner import gpu_ops as ops
    from pdserve.model.config import parse_model_config
    from pdserve.model.loader import build_model
    from pdserve.model.packaged_configs import config_path

    raw = json.loads(config_path(config_name).read_text())
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    cfg = parse_model_config(raw)
    dev = torch.device(device)
    t0 = time.perf_counter()
    model = build_model(cfg, None, torch.bfloat16, dev, "dummy", seed)
    bs = 16
    gen = torch.Generator().manual_seed(seed)
    # seq A: 300 fresh tokens; seq B: 512 tokens whose first 320 arrive in an earlier chunk; seq C: 9 tokens
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (300, 512, 9)]
    steps_plan: list[list[tuple[int, int]]] = [[(1, 320)], [(0, 300), (1, 512), (2, 9)]]  # (seq, upto)
    tables = []
    nxt = 1
    for p in prompts:
        nb = (len(p) + decode_steps + bs - 1) // bs
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    num_blocks = nxt + 1

    def run(path: str) -> list[torch.Tensor]:
        dtype = torch.float32 if path == "ref-fp32" else torch.bfloat16
        pool = torch.zeros((num_blocks, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim), dtype=dtype,
                           device=dev)
        if path == "triton":
            model.fused_ops, backend = ops, TritonAttention(num_sms=None if dev.type == "cuda" else 4)
        else:
            model.fused_ops, backend = None, SdpaReference()
        toks = [list(p) for p in prompts]
        cached = [0, 0, 0]
        logits_out = []
        with torch.inference_mode():
            for plan in steps_plan:
                seqs = [(toks[i][:upto], cached[i]) for i, upto in plan]
                ids, pos, meta, rows = _meta_for(seqs, [tables[i] for i, _ in plan], bs, dev)
                hidden = model(ids, pos, pool, meta, backend)
                for i, upto in plan:
                    cached[i] = upto
                logits_out.append(model.compute_logits(hidden[rows]).float())
            for step in range(decode_steps):
                # every path feeds the same tokens: a fixed function of the step
                for i in range(3):
                    toks[i].append((step * 7919 + i * 104729) % cfg.vocab_size)
                seqs = [(toks[i], cached[i]) for i in range(3)]
                ids, pos, meta, rows = _meta_for(seqs, tables, bs, dev)
                hidden = model(ids, pos, pool, meta, backend)
                cached = [len(t) for t in toks]
                logits_out.append(model.compute_logits(hidden[rows]).float())
        model.fused_ops = None
        return logits_out

    out_triton = run("triton")
    out_bf16 = run("ref-bf16")
    model.float()
    out_fp32 = run("ref-fp32")
    model = None  # free the float32 copy (32 GB for 8B) before the next section
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    # step 0 is the first chunk of seq B alone (no sampled row in an engine, but its logits are still defined)
    per_step = []
    for i, (a, b, c) in enumerate(zip(out_triton, out_bf16, out_fp32, strict=True)):
        per_step.append({
            "step": i, "kind": "prefill" if i < len(steps_plan) else "decode",
            "triton_vs_fp32": rel_err(a, c), "bf16ref_vs_fp32": rel_err(b, c), "triton_vs_bf16ref": rel_err(a, b),
            "argmax_agree_triton_fp32": float((a.argmax(-1) == c.argmax(-1)).float().mean()),
        })
    worst_t = max(s["triton_vs_fp32"] for s in per_step)
    worst_b = max(s["bf16ref_vs_fp32"] for s in per_step)
    return {
        "model": config_name, "layers": cfg.num_layers, "steps": per_step,
        "worst_triton_vs_fp32": worst_t, "worst_bf16ref_vs_fp32": worst_b,
        "tolerance": "triton_vs_fp32 <= 1.5 * bf16ref_vs_fp32 + 1e-3 at every step",
        "ok": all(s["triton_vs_fp32"] <= 1.5 * s["bf16ref_vs_fp32"] + 1e-3 for s in per_step),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    report = {
        "kernels": check_kernels(),
        "ops": check_ops(),
        "engines_tiny": check_engines_tiny(),
        "logits_8b": check_8b_logits(),
    }
    print(json.dumps(report, indent=1))
    ok = all(r["ok"] for k in ("kernels", "ops", "engines_tiny") for r in report[k]) and report["logits_8b"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
