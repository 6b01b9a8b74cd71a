"""The CPU paged decode attention kernel over a pool in either order of a block's (layer, K|V) region, side
by side in one run: token-major (`[block_size, kv_heads, head_dim]`, the GPU's and pdserve's CPU order before)
and head-major (`[kv_heads, block_size, head_dim]`, vLLM's CPU backend's and pdserve's CPU default now), at
several block sizes. One "step" is all layers of a decode batch; "cold" reads every layer's own blocks (the
pool far larger than the caches, as in serving), "cached" reuses layer 0's blocks for every layer (what the
sums cost once the bytes are near). Prints the minimum over repeats, and the DRAM rate one core streams.

    python benchmarks/bench_cpu_kv_layout.py            # SmolLM2's shape: 30 layers, 9 heads / 3 KV heads
    python benchmarks/bench_cpu_kv_layout.py --batch 16 --context 1024 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.cpu import native


def step_ms(lib, layout: str, block_size: int, args: argparse.Namespace, cached: bool) -> float:
    per_seq = -(-args.context // block_size)
    num_blocks = args.batch * per_seq + 8
    heads_first = layout == "head-major"
    shape = ((num_blocks, args.layers, 2, args.kv_heads, block_size, args.head_dim) if heads_first
             else (num_blocks, args.layers, 2, block_size, args.kv_heads, args.head_dim))
    pool = torch.randn(shape)
    tables = (torch.arange(args.batch * per_seq, dtype=torch.int32).view(args.batch, per_seq) + 5).contiguous()
    starts = torch.arange(args.batch + 1, dtype=torch.int32)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    ids = torch.arange(args.batch, dtype=torch.int32)
    q = torch.randn(args.batch, args.heads, args.head_dim)
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for layer in range(args.layers):
            k, v = pool[:, 0 if cached else layer, 0], pool[:, 0 if cached else layer, 1]
            if heads_first:  # the [block, token, head, dim] view the kernel takes (it reads strides)
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            native.paged_attention(lib, q, k, v, tables, starts, lens, ids, args.head_dim**-0.5, out)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    lib = native.load()
    if lib is None:
        raise SystemExit("the C kernels are not available (no compiler, or PDSERVE_CPU_KERNELS=0)")
    torch.set_num_threads(args.threads)
    kv_bytes = args.batch * args.context * args.layers * 2 * args.kv_heads * args.head_dim * 4
    x = torch.randn(kv_bytes // 4)
    stream = min(_timed(lambda: x.sum()) for _ in range(5))
    print(f"K/V read per step: {kv_bytes / 1e6:.0f} MB; one core streams {kv_bytes / stream / 1e9:.1f} GB/s "
          f"(torch.sum of as many bytes: {stream * 1000:.1f} ms)")
    print(f"{'block':>5} {'layout':>11} {'cold ms':>8} {'cached ms':>9} {'cold GB/s':>9}")
    for bs in args.block_sizes:
        for layout in ("token-major", "head-major"):
            cold = step_ms(lib, layout, bs, args, cached=False)
            warm = step_ms(lib, layout, bs, args, cached=True)
            print(f"{bs:>5} {layout:>11} {cold:>8.2f} {warm:>9.2f} {kv_bytes / cold / 1e6:>9.1f}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
