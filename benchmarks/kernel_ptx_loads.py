"""Compiles the paged decode and prefill kernels for sm_90 on a machine without a GPU and counts how they load
memory: 16-byte `cp.async` copies (pipelined tiles), vector `ld.global` widths, scalar byte/halfword loads.

Why: the fp8 kernels' speed hinges on whether Triton proves each K/V row 16-byte aligned (then the tiles are
`cp.async.cg ... 16` copies, software-pipelined over num_stages, like the bf16 kernels') or falls back to
narrow synchronous loads (what the earlier fp8 layout, rows of head_dim + 2 bytes, gave: `ld.global.b16`).
This checks it in seconds on the CPU box, before spending GPU time. Needs triton (not the CPU torch wheel):

    PYTHONPATH=.:TRITON_SITE python benchmarks/kernel_ptx_loads.py [--out ptx_dir]

Pointers and strides are marked 16-divisible as Triton's launcher marks them at run time for a real pool
(base pointers of layer views and block strides of the pools are multiples of 16: see fp8_kv's docstring).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.attention import fp8_kv
from pdserve.attention import triton_fp8 as tf8
from pdserve.attention import triton_kernels as tk

# Llama-3.1-8B per rank: 32 query heads, 8 KV heads, head_dim 128, block 16
H, KVH, D, BS = 32, 8, 128, 16


def _compile(fn, signature: dict[str, str], constexprs: dict, divisible: set[str], warps: int, stages: int) -> str:
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return kernel.asm["ptx"]


def loop_loads_waited_in_loop(ptx: str) -> int:
    """Synchronous global loads inside the main loop whose result is used before the loop's back-edge, i.e. in
    the iteration that issued them: each is a wait for a global load's latency per iteration. (A load first used
    only after the back-edge, by the next iteration, is a prefetch.) The main loop: the longest backward branch."""
    lines = ptx.splitlines()
    labels = {ln.split(":")[0]: i for i, ln in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:", ln)}
    loops = [(labels[m.group(1)], i) for i, ln in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)) and labels.get(m.group(1), i) < i]
    if not loops:
        return 0
    start, end = max(loops, key=lambda se: se[1] - se[0])
    waited = 0
    for i in range(start, end):
        m = re.search(r"ld\.global[^{]*\{\s*([^}]*)\}", lines[i])
        if not m:
            continue
        regs = [r.strip() for r in m.group(1).split(",")]
        pattern = re.compile(r"(?<![\w%])(" + "|".join(re.escape(r) for r in regs) + r")(?!\w)")
        if any(pattern.search(ln) and "mov.u" not in ln for ln in lines[i + 1:end]):
            waited += 1
    return waited


def count_loads(ptx: str) -> dict[str, int]:
    """Load instructions in the PTX text (static counts: prologue and loop body of the pipelined loop)."""
    out = {f"cp.async {n}B": len(re.findall(rf"cp\.async\.c[ag]\.shared\.global[^\n]*, {hex(n)},", ptx))
           for n in (16, 8, 4)}
    for width in ("v4.b32", "v2.b32", "b32", "b16", "b8", "u8"):
        out[f"ld.global.{width}"] = len(re.findall(rf"ld\.global(?:\.[a-z0-9:]+)*\.{re.escape(width)}\s", ptx))
    # shared-memory side: byte loads (an 8-bit tile moved into an operand layout one value at a time) vs
    # ldmatrix (16-bit operands, transposed or not)
    out["ld.shared.b8"] = len(re.findall(r"ld\.shared\.b8\s", ptx))
    out["ldmatrix"] = len(re.findall(r"ldmatrix\.sync", ptx))
    out["loop loads waited in loop"] = loop_loads_waited_in_loop(ptx)
    return out


def _f16_args(fp8: bool) -> dict:
    """What triton_kernels._read_args passes for bf16 queries on a GPU: fp8 read as float16 by packed PTX."""
    return {"FP8_F16": fp8, "FP8_ASM": fp8}


def decode_ptx(fp8: bool, tile_n: int, warps: int, stages: int) -> str:
    cache_t = "*u8" if fp8 else "*bf16"
    signature = {
        "q_ptr": "*bf16", "stride_q_t": "i32", "stride_q_h": "i32",
        "k_cache_ptr": cache_t, "v_cache_ptr": cache_t, "stride_c_blk": "i32", "stride_c_tok": "i32",
        "stride_c_head": "i32", "block_tables_ptr": "*i32", "stride_bt": "i32", "seq_lens_ptr": "*i32",
        "out_ptr": "*bf16", "stride_o_t": "i32", "stride_o_h": "i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
        "counters_ptr": "*i32", "scale_log2": "fp32", "num_splits": "i32",
    }
    args = tf8.kernel_args(fp8_kv.fp8_format("fp8") if fp8 else None)
    constexprs = {"H": H, "G": H // KVH, "BLOCK_G": 16, "D": D, "BLOCK_D": D, "BLOCK_SIZE": BS, "TILE_N": tile_n,
                  "DOT_PRECISION": "tf32", "EVEN_D": True, "KV_FP8": args["KV_FP8"], "FP8_MANT": args["FP8_MANT"],
                  "KVH": KVH, "FUSED_MERGE": False, "MERGE_G": H // KVH, "MERGE_S": 8, **_f16_args(fp8)}
    divisible = {"q_ptr", "stride_q_t", "stride_q_h", "k_cache_ptr", "v_cache_ptr", "stride_c_blk", "stride_c_tok",
                 "block_tables_ptr", "seq_lens_ptr", "out_ptr", "stride_o_t", "stride_o_h", "part_o_ptr",
                 "part_lse_ptr"}
    if not fp8:
        divisible.add("stride_c_head")
    return _compile(tk._decode_kernel, signature, constexprs, divisible, warps, stages)


def prefill_ptx(fp8: bool, block_m: int, tile_n: int, warps: int, stages: int) -> str:
    cache_t = "*u8" if fp8 else "*bf16"
    signature = {
        "q_ptr": "*bf16", "stride_q_t": "i32", "stride_q_h": "i32",
        "k_cache_ptr": cache_t, "v_cache_ptr": cache_t, "stride_c_blk": "i32", "stride_c_tok": "i32",
        "stride_c_head": "i32", "block_tables_ptr": "*i32", "stride_bt": "i32", "seq_lens_ptr": "*i32",
        "qsl_ptr": "*i32", "num_seqs": "i32", "num_q_blocks": "i32", "out_ptr": "*bf16", "stride_o_t": "i32",
        "stride_o_h": "i32", "kv_lo_ptr": "*i32", "flags_ptr": "*i32", "p1_o_ptr": "*bf16", "p1_lse_ptr": "*fp32",
        "p2_o_ptr": "*bf16", "p2_lse_ptr": "*fp32", "stride_po_t": "i32", "stride_po_h": "i32",
        "stride_lse_h": "i32", "p_row0": "i32", "scale_log2": "fp32",
    }
    args = tf8.kernel_args(fp8_kv.fp8_format("fp8") if fp8 else None)
    g = H // KVH
    constexprs = {"G": g, "BLOCK_Q": block_m // g, "BLOCK_M": block_m, "D": D, "BLOCK_D": D, "BLOCK_SIZE": BS,
                  "TILE_N": tile_n, "DOT_PRECISION": "tf32", "EVEN_D": True, "HAS_PARTIALS": False,
                  "KV_FP8": args["KV_FP8"], "FP8_MANT": args["FP8_MANT"], "KVH": KVH, **_f16_args(fp8)}
    divisible = {"q_ptr", "stride_q_t", "stride_q_h", "k_cache_ptr", "v_cache_ptr", "stride_c_blk", "stride_c_tok",
                 "block_tables_ptr", "seq_lens_ptr", "qsl_ptr", "out_ptr", "stride_o_t", "stride_o_h"}
    if not fp8:
        divisible.add("stride_c_head")
    return _compile(tk._prefill_kernel, signature, constexprs, divisible, warps, stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for the PTX files")
    ap.add_argument("--configs", default="64,4,2;128,4,3;128,8,3", help="decode tile,warps,stages;...")
    ap.add_argument("--prefill-configs", default="128,64,8,3", help="prefill block_m,tile,warps,stages;...")
    a = ap.parse_args()
    jobs = []
    for cfg in filter(None, a.configs.split(";")):
        tile_n, warps, stages = (int(x) for x in cfg.split(","))
        for fp8 in (False, True):
            desc = {"kernel": "decode", "tile_n": tile_n, "warps": warps, "stages": stages}
            jobs.append((desc, lambda fp8=fp8, c=(tile_n, warps, stages): decode_ptx(fp8, *c), fp8))
    for cfg in filter(None, a.prefill_configs.split(";")):
        block_m, tile_n, warps, stages = (int(x) for x in cfg.split(","))
        for fp8 in (False, True):
            jobs.append(({"kernel": "prefill", "block_m": block_m, "tile_n": tile_n, "warps": warps,
                          "stages": stages}, lambda fp8=fp8, c=(block_m, tile_n, warps, stages): prefill_ptx(fp8, *c),
                         fp8))
    for desc, make, fp8 in jobs:
        ptx = make()
        row = {**desc, "kv": "fp8_e4m3" if fp8 else "bf16", **count_loads(ptx)}
        print(json.dumps(row), flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            name = "_".join(str(v) for k, v in row.items() if k in (*desc, "kv"))
            Path(a.out, f"{name}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
