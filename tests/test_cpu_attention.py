"""The CPU backend (C paged kernel, C prefill kernel / fresh-prompt SDPA, gather fallback) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.cpu_paged import CpuPagedAttention
from pdserve.attention.torch_ref import TorchAttention
from pdserve.cpu import native

BS = 16


def _lib():
    lib = native.load()
    if lib is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built here")
    return lib


def _step(seqs: list[tuple[int, int]], num_blocks: int, heads: int, kv_heads: int, d: int, seed: int):
    """seqs: (q_len, seq_len) per sequence. Returns the inputs of one layer's write_kv + forward."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, 3, 2, BS, kv_heads, d, generator=g)  # 3 layers: strided per-layer views
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out-of-order blocks
    tables, slots, qsl = [], [], [0]
    for q_len, seq_len in seqs:
        nb = (seq_len + BS - 1) // BS
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        slots.extend(table[j // BS] * BS + j % BS for j in range(seq_len - q_len, seq_len))
        qsl.append(qsl[-1] + q_len)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=BS,
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(s for _, s in seqs),
        decode_only=all(q == 1 for q, _ in seqs),
        query_lens_host=[q for q, _ in seqs],
        seq_lens_host=[s for _, s in seqs],
    )
    n = qsl[-1]
    q = torch.randn(n, heads, d, generator=g)
    k = torch.randn(n, kv_heads, d, generator=g)
    v = torch.randn(n, kv_heads, d, generator=g)
    return pool, q, k, v, meta


CASES = {
    "decode": [(1, 1), (1, 17), (1, 40), (1, 64), (1, 5), (1, 300)],
    "short_chunks": [(3, 20), (16, 16), (1, 33), (7, 7)],
    "fresh_equal_runs": [(24, 24), (24, 24), (24, 24), (9, 9), (24, 24)],
    "mixed": [(1, 50), (40, 40), (40, 40), (30, 70), (1, 2), (17, 17), (5, 100)],
    # fresh prompts longer than the prefill kernel's 64-key tiles and 16-position blocks, between decodes
    "long_fresh": [(130, 130), (1, 20), (77, 77), (1, 9)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("d", [32, 64, 128])  # 64 and 128 have unrolled kernels, others the generic loops
def test_matches_reference(case, heads, kv_heads, d):
    lib = _lib()
    pool, q, k, v, meta = _step(CASES[case], num_blocks=64, heads=heads, kv_heads=kv_heads, d=d, seed=3)
    ref_pool = pool.clone()
    layer = 1
    ours = CpuPagedAttention(lib)
    ref = TorchAttention()
    ours.write_kv(pool[:, layer, 0], pool[:, layer, 1], k, v, meta)
    ref.write_kv(ref_pool[:, layer, 0], ref_pool[:, layer, 1], k, v, meta)
    assert torch.equal(pool, ref_pool)
    out = ours.forward(q, pool[:, layer, 0], pool[:, layer, 1], meta, 0.125)
    expect = ref.forward(q, ref_pool[:, layer, 0], ref_pool[:, layer, 1], meta, 0.125)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["decode", "long_fresh"])
def test_kernel_follows_torch_thread_count(case):
    lib = _lib()
    pool, q, k, v, meta = _step(CASES[case], num_blocks=64, heads=9, kv_heads=3, d=64, seed=5)
    backend = CpuPagedAttention(lib)
    backend.write_kv(pool[:, 0, 0], pool[:, 0, 1], k, v, meta)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(backend.forward(q, pool[:, 0, 0], pool[:, 0, 1], meta, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])  # each (sequence, kv head) is one thread's work: same sums


def test_without_kernels_falls_back_to_reference():
    pool, q, k, v, meta = _step(CASES["mixed"], num_blocks=64, heads=9, kv_heads=3, d=32, seed=7)
    backend = CpuPagedAttention(None)  # what the engine gets where the kernels cannot be built
    backend.write_kv(pool[:, 0, 0], pool[:, 0, 1], k, v, meta)
    out = backend.forward(q, pool[:, 0, 0], pool[:, 0, 1], meta, 0.125)
    expect = TorchAttention().forward(q, pool[:, 0, 0], pool[:, 0, 1], meta, 0.125)
    assert torch.equal(out, expect)
