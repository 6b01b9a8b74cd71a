"""The CPU fused ops (pdserve.cpu.ops) against the decoder's torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.attention.cpu_paged import CpuPagedAttention
from pdserve.cpu import native
from pdserve.model.decoder import RMSNorm
from pdserve.model.rope import apply_rotary


@pytest.fixture(scope="module")
def ops():
    lib = native.load()
    if lib is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built here")
    from pdserve.cpu.ops import CpuOps

    return CpuOps(lib, CpuPagedAttention(lib))


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 576 crosses the kernels' parallel threshold
def test_rms_norm_and_fused_add(ops, rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x, res = torch.randn(rows, 576, generator=g) * 3, torch.randn(rows, 576, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=2e-6, atol=2e-6)
        expect_sum = res + x
        expect = norm(expect_sum)
        got, res_out = ops.fused_add_rms_norm(x, res, norm.weight, 1e-5)
    assert res_out is res and torch.equal(res, expect_sum)  # the add rounds as the torch path's add
    torch.testing.assert_close(got, expect, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_silu_and_mul(ops, rows):
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 6
    gate, up = x.split(1536, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("tokens", [1, 9, 400])
def test_rope_and_write_kv(ops, tokens):
    g = torch.Generator().manual_seed(tokens)
    heads, kvh, d, bs, num_blocks = 9, 3, 64, 16, 64
    qkv = torch.randn(tokens, (heads + 2 * kvh) * d, generator=g)
    q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(-1, heads, d), k.view(-1, kvh, d), v.view(-1, kvh, d)  # strided views, as the decoder has
    pos = torch.randint(0, 4000, (tokens,), generator=g).float()
    freqs = pos[:, None] * (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    pool = torch.zeros(num_blocks, 2, 2, bs, kvh, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    q_out = ops.rope_and_write_kv(q, k, v, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots, bs)
    assert torch.equal(q_out, apply_rotary(q, cos, sin))  # element-wise: bit-exact with the torch path
    k_rot = apply_rotary(k, cos, sin)
    blocks, offs = slots // bs, slots % bs
    assert torch.equal(pool[blocks, 1, 0, offs], k_rot)
    assert torch.equal(pool[blocks, 1, 1, offs], v)
    assert pool[:, 0].abs().sum() == 0  # the other layer untouched
    assert torch.equal(ops.backend._k_new, k_rot)  # fresh prompts attend over these rows


def test_engine_uses_the_kernels_and_matches_the_torch_path(tiny_llama, ops, monkeypatch):
    """The CPU engine runs the C kernels (not a silent fallback), token for token like the torch path."""
    from engine_utils import make_engine, mixed_prompts, run_engine

    from pdserve.cpu.ops import CpuOps
    from pdserve.cpu.packed_linear import PackedLinear
    from pdserve.types.sampling_params import SamplingParams

    fast = make_engine(tiny_llama)
    assert isinstance(fast.runner.model.fused_ops, CpuOps) and fast.runner.backend.lib is not None
    assert isinstance(fast.runner.model.layers[0].mlp.down_proj, PackedLinear)
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    native.load.cache_clear()
    try:
        plain = make_engine(tiny_llama)
    finally:
        native.load.cache_clear()
    assert plain.runner.model.fused_ops is None and plain.runner.backend.lib is None
    prompts = mixed_prompts(fast.model_cfg.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert run_engine(fast, prompts, params) == run_engine(plain, prompts, params)
