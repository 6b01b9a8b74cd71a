"""The long-prefill planner and its torch pieces (gather, the float32 partial attentions) on the CPU. The
whole path (partials + the Triton kernel's merge) runs under Triton's interpreter in test_gpu_kernels.py."""

from __future__ import annotations

import torch

from pdserve.attention import long_prefill as lp
from pdserve.testing.gpu_correctness import make_paged_case, rel_err


def _meta(qlens, slens):
    return make_paged_case(qlens, slens, 2, 1, 8, block_size=4, dtype=torch.float32, device="cpu").meta


def test_plan_takes_long_chunks_with_aligned_bulk_and_bucketed_queries():
    # min_q 8, align 16, bucket 4:
    #  seq 0: short (q 3)             -> none
    #  seq 1: q 8, ctx 40             -> bulk 32, q_pad 8, own
    #  seq 2: q 9, ctx 0              -> q_pad 12: (12/9)^2 = 1.78 > 1.5 and no bulk -> none (Triton alone)
    #  seq 3: q 9, ctx 20             -> bulk 16, not own (padding too costly): Triton does [16, 29)
    #  seq 4: q 12, ctx 5             -> bulk 0, own
    plans = lp.plan_chunks(_meta([3, 8, 9, 9, 12], [3, 48, 9, 29, 17]), min_q=8, ctx_align=16, q_bucket=4)
    got = {p.seq: (p.q_start, p.bulk, p.q_pad, p.own) for p in plans}
    assert got == {1: (3, 32, 8, True), 3: (20, 16, 12, False), 4: (29, 0, 12, True)}


def test_plan_defaults_cover_a_full_budget_chunk_of_a_long_prompt():
    # 8192-token chunk at 24576 tokens of context: all of it to cuDNN, nothing left for Triton but the merge
    (p,) = lp.plan_chunks(_meta([1, 8192], [300, 32768]))
    assert (p.seq, p.q_start, p.bulk, p.q_pad, p.own) == (1, 1, 24576, 8192, True)
    assert lp.plan_chunks(_meta([2047], [9000])) == []  # too short a chunk


def test_gather_kv_reads_the_sequence_in_order():
    c = make_paged_case([5], [11], 2, 2, 8, block_size=4, dtype=torch.float32, device="cpu", seed=1)
    k = lp.gather_kv(c.k_cache, c.meta.block_tables[0], 11)
    assert k.shape == (11, 2, 8) and k.is_contiguous()
    for pos in range(11):
        blk = int(c.meta.block_tables[0, pos // 4])
        assert torch.equal(k[pos], c.k_cache[blk, pos % 4])


def test_partials_over_disjoint_keys_merge_into_one_softmax():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((7, 4, 8), generator=gen)
    k = torch.randn((20, 2, 8), generator=gen)
    v = torch.randn((20, 2, 8), generator=gen)
    whole, lse_whole = lp._attend_math(q, k, v, False, 0.3)
    a, lse_a = lp._attend_math(q, k[:13], v[:13], False, 0.3)
    b, lse_b = lp._attend_math(q, k[13:], v[13:], False, 0.3)
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    merged = (a * wa.T[..., None] + b * wb.T[..., None]) / (wa + wb).T[..., None]
    assert rel_err(merged, whole) < 1e-6
    assert torch.allclose(m + torch.log(wa + wb), lse_whole, atol=1e-5)


def test_padded_causal_rows_do_not_change_real_rows():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((5, 2, 8), generator=gen)
    k = torch.randn((5, 2, 8), generator=gen)
    want, lse = lp._attend_math(q, k, k, True, 0.5)
    got, lse_p = lp._attend_math(lp._pad_rows(q, 8), lp._pad_rows(k, 8), lp._pad_rows(k, 8), True, 0.5)
    assert rel_err(got[:5], want) < 1e-6 and torch.allclose(lse_p[:, :5], lse, atol=1e-6)


def test_causal_chunk_flops_counts_the_triangle():
    # 4 queries at the end of 10 positions see 7, 8, 9, 10 keys
    assert lp.causal_chunk_flops(1, 1, 4, 10) == 4.0 * (7 + 8 + 9 + 10)


def test_whole_fresh_prompt_is_one_causal_call():
    from pdserve.testing.gpu_correctness import SdpaReference

    c = make_paged_case([12], [12], 4, 2, 8, block_size=4, dtype=torch.float32, device="cpu", seed=3)
    (p,) = lp.plan_chunks(c.meta, min_q=8, ctx_align=16, q_bucket=4)
    assert lp.is_whole_fresh_prompt(p)
    got = lp.attend_fresh_prompt(c.q, c.k_cache, c.v_cache, c.meta, 0.3, impl="math")
    assert rel_err(got, SdpaReference().forward(c.q, c.k_cache, c.v_cache, c.meta, 0.3)) < 1e-6


def test_attention_backend_names_are_checked():
    import pytest

    from pdserve.engine.runner.model_runner import select_attention_backend

    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_attention_backend(torch.device("cpu"), None, "triton-cudnn")
    with pytest.raises(ValueError, match="must be one of"):
        select_attention_backend(torch.device("cpu"), None, "flash-attn")
