"""The GPU kernels' logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Skipped where triton is not installed (the CPU torch wheel does not bring it): a developer runs them with
`pip install triton` in the venv. On the GPU machine, pdserve/testing/gpu_correctness.py checks the
compiled kernels on full-size inputs.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests need the interpreter: triton was imported before TRITON_INTERPRET was set",
                allow_module_level=True)

import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as _interp  # noqa: E402

from pdserve.attention import triton_fp8 as tf8  # noqa: E402
from pdserve.attention import triton_kernels as tk  # noqa: E402
from pdserve.testing.gpu_correctness import SdpaReference, check_ops, make_paged_case, rel_err  # noqa: E402

# triton 3.6's interpreter holds scalars as 1-element arrays and converts them with int(), which numpy 2
# refuses for 1-D arrays: `range(tensor)` in a kernel fails. Convert through the single element instead.
_orig_patch = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _orig_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor

CASES = [
    # query lens, seq lens, heads, kv heads, head dim
    ([7, 5, 1, 20], [7, 13, 9, 20], 4, 2, 16),  # fresh, chunk after context, decode row, several q blocks
    ([3, 33], [40, 33], 6, 2, 16),  # GQA group of 3 (not a power of two)
    ([9], [30], 2, 2, 24),  # head_dim not a power of two, MHA
    ([1, 1, 1], [1, 17, 30], 4, 1, 16),  # decode, group of 4 over one kv head
]


@pytest.mark.parametrize("qlens,slens,h,kvh,d", CASES)
def test_prefill_kernel_matches_sdpa(qlens, slens, h, kvh, d):
    c = make_paged_case(qlens, slens, h, kvh, d, block_size=4, dtype=torch.float32, device="cpu", seed=len(qlens))
    want = SdpaReference().forward(c.q, c.k_cache, c.v_cache, c.meta, d**-0.5)
    out = torch.full_like(c.q, float("nan"))
    tk.prefill_attention(c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.seq_lens, c.meta.query_start_loc,
                         d**-0.5, len(qlens), out=out, block_m=16, tile_n=16)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("tile_n", [16, 32])
def test_prefill_kernel_finishes_long_chunks_from_library_partials(tile_n):
    """pdserve.attention.long_prefill: partials over [0, bulk) and the own keys (here the float32 "math"
    stand-in for cuDNN), merged by the kernel, which attends what is left; other sequences in the same
    launch are untouched by it. Covers bulk + own, bulk only (Triton does the causal own keys), own only
    (Triton does the short context), and a short sequence and a decode row beside them."""
    from pdserve.attention import long_prefill as lp

    qlens, slens = [3, 8, 9, 12, 1, 8], [3, 48, 45, 17, 40, 8]
    c = make_paged_case(qlens, slens, 4, 2, 16, block_size=4, dtype=torch.float32, device="cpu", seed=tile_n)
    want = SdpaReference().forward(c.q, c.k_cache, c.v_cache, c.meta, 0.25)
    plans = lp.plan_chunks(c.meta, min_q=8, ctx_align=32, q_bucket=4)
    assert {(p.seq, p.bulk, p.own) for p in plans} == {(1, 32, True), (2, 32, False), (3, 0, True), (5, 0, True)}
    partials = lp.compute_partials(c.q, c.k_cache, c.v_cache, c.meta, plans, 0.25, impl="math")
    out = torch.full_like(c.q, float("nan"))
    tk.prefill_attention(c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.seq_lens, c.meta.query_start_loc,
                         0.25, len(qlens), out=out, block_m=16, tile_n=tile_n, partials=partials)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("splits,fused_merge", [(1, False), (2, False), (5, False), (2, True), (5, True), (12, True)])
def test_decode_kernel_matches_sdpa_with_padding_rows(splits, fused_merge):
    """Split-KV decode, the splits merged by a second kernel or (fused_merge) by the last program of each
    (sequence, kv head), whose counters end at rest so that the next launch (a graph replay) works too."""
    long = 170 if splits == 12 else 30  # 12 splits of 11 tiles: 11 non-empty, merged 8 at a time
    c = make_paged_case([1] * 4, [9, 1, long, 16], 6, 2, 16, block_size=4, dtype=torch.float32, device="cpu",
                        seed=splits, table_width=48)  # wider table than needed: the graph's static stride
    want = SdpaReference().forward(c.q, c.k_cache, c.v_cache, c.meta, 0.25)
    seq_lens = c.meta.seq_lens.clone()
    seq_lens[1] = 0  # a CUDA-graph padding row
    counters = tk.new_merge_counters(torch.device("cpu"), 16) if fused_merge else None
    for _ in range(2 if fused_merge else 1):
        out = torch.full_like(c.q, float("nan"))
        tk.decode_attention(c.q, c.k_cache, c.v_cache, c.meta.block_tables, seq_lens, 0.25, splits, out=out,
                            tile_n=16, merge_counters=counters)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        keep = [0, 2, 3]
        assert rel_err(out[keep], want[keep]) < 1e-5
    if counters is not None:
        assert not counters.any()


def test_write_kv_into_strided_pool_view_skips_padding():
    c = make_paged_case([5, 3], [9, 3], 4, 2, 16, block_size=4, dtype=torch.float32, device="cpu")
    k = torch.randn(8, 2, 16)
    v = torch.randn(8, 2, 16)
    slots = c.meta.slot_mapping.clone()
    slots[2] = -1
    want = c.pool.clone()
    ref = SdpaReference()
    ref.write_kv(want[:, c.layer, 0], want[:, c.layer, 1], k, v, type(c.meta)(**{**c.meta.__dict__,
                                                                                   "slot_mapping": slots}))
    tk.write_kv(c.k_cache, c.v_cache, k, v, slots, 4)
    assert torch.equal(c.pool, want)


def test_fused_ops_match_the_torch_path_in_float32():
    for item in check_ops(dtype=torch.float32, device="cpu"):
        assert item["ok"], item


def test_gpu_step_runner_is_token_exact_with_the_cpu_engine(tiny_llama):
    """The CUDA step path (numpy-built batches, decode-graph static buffers with padding rows, fused ops,
    Triton attention, greedy argmax) run eagerly on the CPU: same tokens as the CPU engine, through
    chunked prefill and prefix-cache hits."""
    from engine_utils import make_engine, run_engine

    from pdserve.attention.triton_backend import TritonAttention
    from pdserve.types.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 320, (50,), generator=gen).tolist()
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 40, 70)] + [shared]
    again = [shared[:36] + [7, 8, 9], shared]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # decodes cross block ends
    kw = dict(max_num_batched_tokens=32, max_num_seqs=5)
    ref_engine = make_engine(tiny_llama, **kw)
    want = run_engine(ref_engine, prompts, params) + run_engine(ref_engine, again, params)
    engine = make_engine(tiny_llama, **kw)
    engine.runner.backend = TritonAttention(num_sms=4)
    engine.runner.use_gpu_step_runner(simulate_graphs=True)
    got = run_engine(engine, prompts, params) + run_engine(engine, again, params)
    assert got == want
    assert engine.runner.step_timing.graph_steps > 0
    assert engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batch1_decode_epilogues_are_token_exact(tiny_model_factory, arch, monkeypatch):
    """One request at a time, so that every decode step is a batch-1 graph step: the qkv GEMV with RoPE and
    the K/V store in its epilogue, gate_up with SiLU-and-mul, o_proj and down_proj with the residual add and
    RMSNorm, the LM head with the argmax, and the split-KV merge inside the attention kernel; the same tokens
    as the CPU engine (Qwen2: the qkv bias too)."""
    from engine_utils import make_engine, run_engine

    from pdserve.attention import triton_backend as tb
    from pdserve.cpu import packed_linear
    from pdserve.engine.runner import gemv
    from pdserve.engine.runner import gpu_ops as ops
    from pdserve.types.sampling_params import SamplingParams

    model = tiny_model_factory(arch)
    monkeypatch.setattr(gemv, "EPILOGUE_FUSIONS", True)  # (whatever PDSERVE_DECODE_FUSIONS says)
    used = {"qkv_rope_and_write_kv": 0, "gate_up_silu": 0, "lm_head_argmax": 0, "linear_add_rms_norm": 0}
    for name in used:
        real = getattr(ops, name)

        def counted(*a, _real=real, _name=name, **k):
            out = _real(*a, **k)
            used[_name] += out is not None
            return out

        monkeypatch.setattr(ops, name, counted)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 44)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)  # decodes cross block ends
    kw = dict(max_num_batched_tokens=32, max_num_seqs=2)
    ref_engine = make_engine(model, **kw)
    want = [run_engine(ref_engine, [p], params)[0] for p in prompts]
    # 16-key tiles and 4 "SMs": batch 1 splits its keys 8 ways, up to 4 of them non-empty here
    monkeypatch.setattr(tb, "DECODE_CONFIGS", [(1 << 30, 16, 4, 1, 4)])
    # plain nn.Linear layers, as on CUDA (the CPU engine packs them for oneDNN, which the GEMVs do not take)
    monkeypatch.setattr(packed_linear, "pack_linears", lambda model, dtype: 0)
    engine = make_engine(model, **kw)
    engine.runner.backend = tb.TritonAttention(num_sms=4)
    engine.runner.backend.fused_decode_merge = True
    engine.runner.use_gpu_step_runner(simulate_graphs=True)
    got = [run_engine(engine, [p], params)[0] for p in prompts]
    assert got == want
    assert engine.runner.step_timing.graph_steps >= 2 * 9
    assert min(used.values()) >= 2 * 9, used
    assert not engine.runner.backend._merge_counters.any()


def test_gpu_step_runner_with_long_prefill_partials_is_token_exact(tiny_llama, monkeypatch):
    """The long-prefill split (library partials over gathered K/V, here float32 torch ops standing in for
    cuDNN, finished by the Triton kernel) inside the engine, at toy thresholds so that chunked prefill and a
    prefix-cache hit both produce chunks with bulk context and own keys: same tokens as the CPU engine."""
    from engine_utils import make_engine, run_engine

    from pdserve.attention import long_prefill as lp
    from pdserve.attention import triton_backend as tb
    from pdserve.types.sampling_params import SamplingParams

    monkeypatch.setattr(tb, "PREFILL_CONFIG_SHORT", (16, 16, 4, 1))
    monkeypatch.setattr(tb, "PREFILL_CONFIG_LONG", (16, 16, 4, 1))
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 320, (90,), generator=gen).tolist()
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (9, 75)] + [shared]
    again = [shared[:64] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4)
    ref_engine = make_engine(tiny_llama, **kw)
    want = run_engine(ref_engine, prompts, params) + run_engine(ref_engine, again, params)
    engine = make_engine(tiny_llama, **kw)
    backend = tb.TritonAttention(num_sms=4, long_prefill=lp.LongPrefillConfig("math", min_q=8, ctx_align=16,
                                                                                 q_bucket=4))
    calls = []
    real = lp.compute_partials
    monkeypatch.setattr(lp, "compute_partials", lambda *a, **k: calls.append(len(a[4])) or real(*a, **k))
    engine.runner.backend = backend
    engine.runner.use_gpu_step_runner(simulate_graphs=True)
    got = run_engine(engine, prompts, params) + run_engine(engine, again, params)
    assert got == want
    assert calls and engine.stats().prefix_cache_hits > 0


# ---- fp8 KV cache (pdserve.attention.fp8_kv rows read and written by the kernels) ----------------------
FP8_CASES = [
    {"name": "mixed", "q": [7, 5, 1, 20], "s": [7, 13, 9, 20], "h": 4, "kvh": 2, "d": 16},
    {"name": "decode", "q": [1, 1, 1], "s": [1, 17, 30], "h": 6, "kvh": 2, "d": 16},
]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kernels_match_sdpa_on_dequantized_kv_and_store_the_cpu_bytes(fmt):
    """Decode (several splits) and prefill over an fp8 pool == SDPA over the dequantized pool; write_kv and
    the fused RoPE store write exactly fp8_kv.quantize_rows's bytes (CPU and GPU pools interchange)."""
    from pdserve.testing.gpu_correctness import check_fp8_kernels

    results = check_fp8_kernels(torch.float32, "cpu", FP8_CASES, (fmt,), block_size=4, tile_n=16, block_m=16,
                                splits_list=(1, 3))
    # 2 prefill, 2 decode splits, 2 with stale bytes past the sequences' ends, 2 stores x (per-row, static
    # checkpoint scales)
    assert len(results) == 10
    for item in results:
        assert item["ok"], item


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(("block_size", "tile_n"), [(4, 16), (32, 16)])
def test_fp8_kernels_with_16_bit_queries_read_kv_as_float16(fmt, block_size, tile_n):
    """16-bit queries: the read kernels take fp8 K/V as exact float16 values (triton_fp8.fp8_to_f16; Triton's
    own conversion here, packed PTX on a GPU) and run the products in float16: same attention as SDPA over the
    dequantized pool, to 16-bit precision. V, stored dim-major, is read as whole blocks per tile (block 4,
    tile 16) and per token where a block spans several tiles (block 32, tile 16)."""
    from pdserve.testing.gpu_correctness import check_fp8_kernels

    results = check_fp8_kernels(torch.float16, "cpu", FP8_CASES, (fmt,), block_size=block_size, tile_n=tile_n,
                                block_m=16, splits_list=(1, 3))
    # 2 prefill, 2 decode splits, 2 with stale bytes past the ends
    assert sum(r["kernel"].startswith(("decode", "prefill")) for r in results) == 6
    for item in results:
        assert item["ok"], item
    assert max(r.get("rel_err", 0.0) for r in results) < 5e-3  # 16-bit rounding


@pytest.mark.parametrize("tile_n", [16, 8])
def test_fp8_v_bytes_past_the_sequence_do_not_reach_the_output(tile_n):
    """The V tile that holds a sequence's end reads that block's whole rows (16-byte copies): the bytes past
    the sequence (stale data of an earlier owner; here the format's largest code) must get weight 0. Decode and
    prefill over a pool with such tails equal SDPA over the clean pool. (They are never NaN codes, which
    0 * NaN would leak: fp8 pools are zero-allocated and the writers clamp; triton_fp8.load_v_tile.)"""
    from pdserve.attention import fp8_kv
    from pdserve.testing.gpu_correctness import fp8_case

    qlens, slens = [1, 1, 3], [9, 21, 11]
    c8, cf = fp8_case(make_paged_case(qlens, slens, 4, 2, 16, block_size=8, dtype=torch.float16, device="cpu",
                                      seed=9, spare_blocks=2), "fp8_e4m3")
    fmt = fp8_kv.fp8_format("fp8_e4m3")
    want = SdpaReference(torch.float32).forward(cf.q, cf.k_cache, cf.v_cache, cf.meta, 0.25).float()
    values, _ = fp8_kv.layer_views(c8.v_cache, is_v=True)  # [blocks, heads, block_size, d]
    for b, n in enumerate(slens):
        values[int(c8.meta.block_tables[b, (n - 1) // 8]), :, (n - 1) % 8 + 1:] = 0x7E  # 448
    out = torch.full_like(c8.q, float("nan"))
    tk.prefill_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens,
                         c8.meta.query_start_loc, 0.25, len(qlens), out=out, kv_format=fmt, block_m=16, tile_n=tile_n)
    assert rel_err(out, want) < 5e-3
    rows = slice(0, 2)  # the decode rows alone through the decode kernel
    got = tk.decode_attention(c8.q[rows], c8.k_cache, c8.v_cache, c8.meta.block_tables[rows],
                              c8.meta.seq_lens[rows], 0.25, 2, kv_format=fmt, tile_n=tile_n)
    assert rel_err(got, want[rows]) < 5e-3


@triton.jit
def _fp8_bytes_to_f16(src, dst, FP8_MANT: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(dst + i, tf8.fp8_to_f16(tl.load(src + i), FP8_MANT, False))


def test_fp8_to_f16_is_exact_for_every_byte():
    """Every e4m3 and e5m2 byte (but NaN) decodes to its value in float16 (subnormals included)."""
    raw = torch.arange(256, dtype=torch.uint8)
    for mant, dtype in ((3, torch.float8_e4m3fn), (2, torch.float8_e5m2)):
        out = torch.empty(256, dtype=torch.float16)
        _fp8_bytes_to_f16[(1,)](raw, out, FP8_MANT=mant)
        want = raw.view(dtype).float()
        finite = want.isfinite()
        assert torch.equal(out.float()[finite], want[finite])


def test_fp8_long_prefill_partials_dequantize_gathered_kv():
    """The long-prefill split over an fp8 pool: gathered K/V are dequantized for the library (here the
    float32 math stand-in), the kernel finishes from the partials reading fp8 itself."""
    from pdserve.attention import fp8_kv
    from pdserve.attention import long_prefill as lp
    from pdserve.testing.gpu_correctness import fp8_case

    qlens, slens = [3, 8, 12, 1], [3, 48, 17, 40]
    c8, cf = fp8_case(make_paged_case(qlens, slens, 4, 2, 16, block_size=4, dtype=torch.float32, device="cpu",
                                      seed=5), "fp8_e4m3")
    fmt = fp8_kv.fp8_format("fp8_e4m3")
    want = SdpaReference().forward(cf.q, cf.k_cache, cf.v_cache, cf.meta, 0.25)
    plans = lp.plan_chunks(c8.meta, min_q=8, ctx_align=32, q_bucket=4)
    assert {(p.seq, p.bulk, p.own) for p in plans} == {(1, 32, True), (2, 0, True)}
    partials = lp.compute_partials(c8.q, c8.k_cache, c8.v_cache, c8.meta, plans, 0.25, impl="math", kv_format=fmt)
    out = torch.full_like(c8.q, float("nan"))
    tk.prefill_attention(c8.q, c8.k_cache, c8.v_cache, c8.meta.block_tables, c8.meta.seq_lens,
                         c8.meta.query_start_loc, 0.25, len(qlens), out=out, block_m=16, tile_n=16, partials=partials,
                         kv_format=fmt)
    assert rel_err(out, want) < 1e-5


def test_gpu_step_runner_with_fp8_kv_is_token_exact_with_the_cpu_fp8_engine(tiny_llama):
    """--kv-cache-dtype fp8 through the CUDA step path (fused RoPE + fp8 store, decode-graph buffers, the
    Triton kernels reading fp8): same tokens as the CPU engine's fp8 path (Fp8GatherAttention), since both
    read the same bytes and dequantize exactly in float32."""
    from engine_utils import make_engine, run_engine

    from pdserve.attention import fp8_kv
    from pdserve.attention.triton_backend import TritonAttention
    from pdserve.types.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 320, (40,), generator=gen).tolist()
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 37)] + [shared]
    again = [shared[:36] + [7, 8, 9]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4, kv_cache_dtype="fp8")
    ref_engine = make_engine(tiny_llama, **kw)
    assert ref_engine.runner.backend.name.endswith("+fp8-gather")
    want = run_engine(ref_engine, prompts, params) + run_engine(ref_engine, again, params)
    engine = make_engine(tiny_llama, **kw)
    engine.runner.backend = TritonAttention(num_sms=4, kv_format=fp8_kv.fp8_format("fp8"))
    engine.runner.use_gpu_step_runner(simulate_graphs=True)
    got = run_engine(engine, prompts, params) + run_engine(engine, again, params)
    assert got == want
    assert engine.runner.step_timing.graph_steps > 0
    assert engine.stats().prefix_cache_hits > 0
    pools = ref_engine.runner.kv_pool, engine.runner.kv_pool
    assert pools[0].dtype == pools[1].dtype == torch.uint8


def test_gpu_step_runner_with_checkpoint_kv_scales_is_token_exact_with_the_cpu_fp8_engine(tiny_llama, tmp_path):
    """A checkpoint's static k_scale/v_scale through the CUDA step path (the fused RoPE + fp8 store takes
    them, the Triton kernels read the slots as ever): same tokens as the CPU engine's fp8 path with the same
    scales, since both write the same bytes."""
    from engine_utils import make_engine, run_engine
    from test_kv_fp8_static_scales import scale_tensors, with_tensors

    from pdserve.attention import fp8_kv
    from pdserve.attention.triton_backend import TritonAttention
    from pdserve.types.sampling_params import SamplingParams

    model_dir = with_tensors(tiny_llama, tmp_path / "tiny-llama", scale_tensors([(0.02, 0.015), (0.03, 0.01)], "vllm"))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 37, 20)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4, kv_cache_dtype="fp8")
    ref_engine = make_engine(model_dir, **kw)
    assert ref_engine.runner.kv_scales_source == "checkpoint"
    want = run_engine(ref_engine, prompts, params)
    engine = make_engine(model_dir, **kw)
    engine.runner.backend = TritonAttention(num_sms=4, kv_format=fp8_kv.fp8_format("fp8"))
    engine.runner.use_gpu_step_runner(simulate_graphs=True)
    assert run_engine(engine, prompts, params) == want
    assert engine.runner.step_timing.graph_steps > 0
    assert torch.equal(engine.runner.kv_pool, ref_engine.runner.kv_pool)


@pytest.mark.parametrize("shape,dtype", [((5, 3, 2, 16, 2, 40), torch.bfloat16), ((4, 2, 2, 4, 2, 18), torch.uint8)])
def test_lanesum_kernel_is_the_reference(shape, dtype):
    """The KV digests' fused lane-sum kernel (pdserve/kv_transfer/lanesum_kernel.py) equals its numpy reference:
    rows of several tiles (a small BLOCK), scattered and repeated block ids."""
    from pdserve.kv_transfer import lanesum_kernel

    g = torch.Generator().manual_seed(2)
    pool = torch.randint(0, 256, shape, dtype=dtype, generator=g) if dtype == torch.uint8 \
        else torch.randn(shape, generator=g).to(dtype)
    ids = [shape[0] - 1, 0, 2, 2]
    rows = pool.view(torch.uint8).reshape(shape[0], -1).numpy()[ids]
    old = lanesum_kernel._BLOCK
    lanesum_kernel._BLOCK = 32  # several loop iterations per row, and a masked last tile
    try:
        got = lanesum_kernel.lanesum_triton(pool, ids, shape[1] * shape[2])
    finally:
        lanesum_kernel._BLOCK = old
    assert got == lanesum_kernel.lanesum_reference(rows, shape[1] * shape[2])
