"""The speculative verify step in CUDA graphs (pdserve.engine.runner.verify_graphs), checked on the CPU: the
graphs' static buffers, padding and row selection run eagerly (`simulate_graphs`), with the torch reference
attention and, where triton is installed, the Triton kernels under the interpreter. The GPU machine runs the
compiled kernels and real captures (python -m pdserve.testing.spec_verify_check)."""

from __future__ import annotations

import os

import pytest
import torch
from engine_utils import make_engine, mixed_prompts, run_engine
from test_async_scheduling import simulate_gpu_path
from test_spec_decode import NGRAM, repetitive_prompts

from pdserve.engine.runner.verify_graphs import verify_graph_sizes
from pdserve.types.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return make_engine(tiny_llama, max_num_seqs=4)


def _graph_engine(tiny_llama, **kw):
    kw.setdefault("max_num_seqs", 4)
    return simulate_gpu_path(make_engine(tiny_llama, speculative_config=NGRAM, **kw))


class _Recorder:
    """Wraps the verify graphs' run: records each step's draft lengths and the rows it padded."""

    def __init__(self, verify):
        self.verify = verify
        self.drafts: list[list[int]] = []
        orig = verify.run

        def run(batch, size, want_argmax):
            self.drafts.append([len(r.spec_token_ids) for r, _ in batch] + [-1] * (size - len(batch)))
            return orig(batch, size, want_argmax)

        verify.run = run


def test_verify_steps_replay_graphs_with_uneven_drafts_token_exact(tiny_llama, plain):
    """Every verify step of decode-phase requests takes a graph, whatever its draft lengths (0..K, padded to K)
    and batch (padded to the bucket): tokens as without speculation, the same acceptance as the eager verify."""
    eng = _graph_engine(tiny_llama)
    gpu = eng.runner.gpu
    assert gpu.verify_graphs == verify_graph_sizes(gpu.graph_sizes) == [1, 2, 4]
    rec = _Recorder(gpu.verify)
    prompts = repetitive_prompts(320)[:2] + mixed_prompts(320, lengths=(20,))
    want = run_engine(plain, prompts, GREEDY)
    assert run_engine(eng, prompts, GREEDY) == want
    steps = rec.drafts
    assert gpu.verify_graph_steps == len(steps) > 0
    uneven = [d for d in steps if len({x for x in d if x >= 0}) > 1]
    assert uneven, "no step mixed draft lengths: the padding went untested"
    assert any(-1 in d for d in steps), "no step padded the batch to its bucket"
    assert any(0 in d for d in steps), "no request without drafts rode in a verify graph"
    # the eager verify step gives the same acceptance, step for step
    eager = _graph_engine(tiny_llama)
    eager.runner.gpu.verify_graphs_on = False
    assert run_engine(eager, prompts, GREEDY) == want
    assert eager.runner.gpu.verify_graph_steps == 0
    a, b = eng.stats().spec_decode, eager.stats().spec_decode
    assert a.num_accepted_tokens == b.num_accepted_tokens > 0 and a.num_draft_tokens == b.num_draft_tokens


def test_padded_rows_do_not_change_the_real_rows(tiny_llama):
    """One verify step run twice from the same state: as the graph pads it (a request with fewer drafts than K)
    and with the padded rows' tokens changed to others. The real rows' logits are the same bits, and the
    padded rows stored no K/V (the pool is unchanged past each request's real rows)."""
    eng = _graph_engine(tiny_llama, max_num_seqs=2)
    gpu = eng.runner.gpu
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5]
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    while not all(len(r.output_token_ids) >= 1 for r in eng.scheduler.running) or len(eng.scheduler.running) < 2:
        eng.step()
    reqs = list(eng.scheduler.running)
    reqs[0].spec_token_ids = [9, 5]  # 2 drafts of K = 4
    reqs[1].spec_token_ids = []  # none: 4 padded rows
    for r in reqs:
        assert eng.blocks.allocate(r, r.num_tokens + len(r.spec_token_ids))
    batch = [(r, 1 + len(r.spec_token_ids)) for r in reqs]
    size = gpu.verify.fits(batch)
    assert size == 2
    pool0 = eng.runner.kv_cache.clone()
    with torch.inference_mode():  # as the model runner runs steps
        _, logits_a, argmax_a = gpu.verify.run(batch, size, want_argmax=True)
    pool_a = eng.runner.kv_cache.clone()
    # the padded rows' token ids are the last real token; rerun with them replaced
    orig_forward = gpu.verify.forward
    rows = gpu.verify.rows

    def forward_noisy(sz):
        hdr = gpu.verify._dev
        for b, r in enumerate(reqs):
            q = 1 + len(r.spec_token_ids)
            hdr[b * rows + q : (b + 1) * rows] = torch.arange(100, 100 + rows - q)
        return orig_forward(sz)

    gpu.verify.forward = forward_noisy
    with torch.inference_mode():
        _, logits_b, argmax_b = gpu.verify.run(batch, size, want_argmax=True)
    gpu.verify.forward = orig_forward
    assert logits_a.shape[0] == 4 and torch.equal(logits_a, logits_b) and argmax_a == argmax_b
    assert torch.equal(eng.runner.kv_cache, pool_a)
    changed = (eng.runner.kv_cache != pool0).flatten(1).any(dim=1).nonzero().flatten().tolist()
    owned = {b for r in reqs for b in r.block_ids}
    assert changed and set(changed) <= owned
    # exactly the real rows' slots were written: the pool differs from before only at those positions
    bs = eng.runner.block_size
    written = set()
    for r in reqs:
        for t in range(r.num_computed_tokens, r.num_tokens + len(r.spec_token_ids)):
            written.add((r.block_ids[t // bs], t % bs))
    diff = (eng.runner.kv_cache != pool0)  # [blocks, layers, 2, block_size, heads, d]
    got = {(int(b), int(o)) for b, o in diff.any(dim=(1, 2, 4, 5)).nonzero().tolist()}
    assert got == written
    for r in reqs:
        eng.abort_request(r.request_id)


def test_steps_that_do_not_fit_run_eagerly(tiny_llama, plain):
    """Prefill chunks beside drafts, prompt logprobs, more running requests than the largest verify graph:
    eager verify steps, same tokens; PDSERVE_SPEC_VERIFY_GRAPHS=0 builds no verify graphs."""
    eng = _graph_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=24)
    gpu = eng.runner.gpu
    gpu.verify.sizes = [1, 2]  # as if the largest verify graph were batch 2: batch 3-4 verify steps run eagerly
    prompts = repetitive_prompts(320)[:3] + [list(range(40, 100))]  # the long one prefills in chunks
    params = [GREEDY] * 3 + [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=1)]
    assert run_engine(eng, prompts, params) == run_engine(plain, prompts, params)
    steps = eng.runner.step_timing.steps
    assert 0 < gpu.verify_graph_steps < steps
    os.environ["PDSERVE_SPEC_VERIFY_GRAPHS"] = "0"
    try:
        off = _graph_engine(tiny_llama)
    finally:
        del os.environ["PDSERVE_SPEC_VERIFY_GRAPHS"]
    assert off.runner.gpu.verify is None and off.runner.gpu.verify_graphs == []
    assert run_engine(off, prompts[:2], GREEDY) == run_engine(plain, prompts[:2], GREEDY)


def test_random_sampling_and_logprobs_take_the_graph_logits(tiny_llama, plain):
    """Non-greedy rows and logprobs read the real rows' logits from the graph (no argmax shortcut): seeded
    sampling repeats the eager verify step's draws, logprobs equal the plain engine's."""
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    lp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    prompts = repetitive_prompts(320)[:2]
    outs = []
    for graphs in (True, False):
        eng = _graph_engine(tiny_llama)
        eng.runner.gpu.verify_graphs_on = graphs
        outs.append((run_engine(eng, prompts, sp), run_engine(eng, prompts, lp), eng.runner.gpu.verify_graph_steps))
    assert outs[0][0] == outs[1][0] and outs[0][1] == outs[1][1] == run_engine(plain, prompts, lp)
    assert outs[0][2] > 0 and outs[1][2] == 0


def test_triton_kernels_in_the_verify_graph_path(tiny_llama, plain):
    """The same path with the Triton backend (multi-query decode kernel, fused ops) under the interpreter."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    import test_gpu_kernels  # noqa: F401  (the interpreter's numpy-2 patch)

    from pdserve.attention.triton_backend import TritonAttention

    eng = make_engine(tiny_llama, speculative_config=NGRAM, max_num_seqs=2)
    eng.runner.backend = TritonAttention(num_sms=4)
    eng.runner.use_gpu_step_runner(simulate_graphs=True)
    assert eng.runner.gpu.verify_graphs == [1, 2]
    prompts = repetitive_prompts(320)[:2]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert run_engine(eng, prompts, sp) == run_engine(plain, prompts, sp)
    assert eng.runner.gpu.verify_graph_steps > 0


def test_verify_kernel_matches_sdpa_with_padded_drafts():
    """The multi-query decode kernel (rows_per_seq = K + 1) under the interpreter: real rows vs SDPA, padded
    rows finite, padding sequences zero; float and fp8 pools, 1 to 5 splits."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    import test_gpu_kernels  # noqa: F401

    from pdserve.testing.spec_verify_check import check_verify_kernel

    cases = [{"name": "uneven+pad", "seqs": [(20, 4), (1, 0), None, (45, 2), (16, 1)], "k": 4, "h": 6, "kvh": 2,
              "d": 16},
             {"name": "k2-gqa3", "seqs": [(31, 2), (2, 1)], "k": 2, "h": 6, "kvh": 2, "d": 16}]
    results = check_verify_kernel(torch.float32, "cpu", cases, block_size=4, tile_n=16, splits_list=(1, 2, 5))
    assert results and all(r["ok"] for r in results), results


def test_a_failed_capture_leaves_verify_steps_eager(tiny_llama, plain, caplog):
    """Capture fails here (no CUDA on the CPU box): nothing is kept, a warning is logged, and with the verify
    graphs dropped (as the step runner drops them then) the engine verifies eagerly, same tokens."""
    eng = _graph_engine(tiny_llama)
    gpu = eng.runner.gpu
    with caplog.at_level("WARNING", logger="pdserve.engine"):
        assert gpu.verify.capture(None) is False
    assert gpu.verify.sizes == [] and not gpu.verify.graphs and "verify steps run eagerly" in caplog.text
    assert gpu.verify.fits([]) is None  # no sizes left: every verify step eager
    gpu.verify = None
    prompts = repetitive_prompts(320)[:2]
    assert run_engine(eng, prompts, GREEDY) == run_engine(plain, prompts, GREEDY)
    assert gpu.verify_graph_steps == 0 and eng.stats().spec_decode.num_accepted_tokens > 0


def test_skinny_gemm_matches_matmul():
    """The experimental few-row linear kernel (PDSERVE_SKINNY_GEMM=1) under the interpreter, float16 (the
    interpreter's dot mishandles bfloat16; the GPU check runs bfloat16 at the 8B shapes)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    import test_gpu_kernels  # noqa: F401

    from pdserve.engine.runner import skinny_gemm as sg

    g = torch.Generator().manual_seed(0)
    for m, n, k, bias in ((5, 40, 512, False), (20, 33, 256, True), (2, 16, 256, False)):
        x = torch.randn(m, k, generator=g).half()
        w = torch.randn(n, k, generator=g).half()
        b = torch.randn(n, generator=g).half() if bias else None
        want = x.float() @ w.float().t() + (b.float() if bias else 0)
        got = sg.skinny_matmul(x, w, b)
        assert got.dtype == torch.float16 and got.shape == (m, n)
        assert float((got.float() - want).abs().max() / want.abs().max()) < 2e-3
    layer = torch.nn.Linear(256, 16, bias=False).half()
    assert sg.skinny_weight(torch.zeros(5, 256).half(), layer) is (layer.weight if sg.ENABLED else None)
    assert sg.skinny_weight(torch.zeros(1, 256).half(), layer) is None  # one row: the GEMV's


def test_mixed_sampling_params_in_one_verify_graph(tiny_llama, plain):
    """Penalties, min_tokens with a stop token, logprobs and plain greedy requests batched in the same verify
    graphs (no argmax shortcut for the batch: the rejection sampler adjusts each row's logits): as without
    speculation."""
    prompts = repetitive_prompts(320)
    full = run_engine(plain, prompts[:1], GREEDY)[0]
    params = [GREEDY,
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4),
              SamplingParams(max_tokens=24, temperature=0, min_tokens=8, stop_token_ids=[full[3]]),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)]
    eng = _graph_engine(tiny_llama)
    assert run_engine(eng, prompts, params) == run_engine(plain, prompts, params)
    assert eng.runner.gpu.verify_graph_steps > 0 and eng.stats().spec_decode.num_accepted_tokens > 0
