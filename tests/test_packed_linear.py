"""oneDNN-packed linears: same results as nn.Linear (to float32 rounding), every batch size, in the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.cpu.packed_linear import PackedLinear, pack_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 300])
def test_packed_matches_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(lin)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_every_linear_and_keeps_tied_embeddings():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16)
    model = nn.ModuleDict({"emb": emb, "a": nn.Linear(16, 8), "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = emb.weight  # tied, as in SmolLM2
    x = torch.randn(4, 16)
    with torch.inference_mode():
        expect = model["head"](x)
    assert pack_linears(model, torch.float32) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model["emb"].weight is emb.weight
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](x), expect, rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_nn_linear():
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_linears(model, torch.bfloat16) == 0
    assert isinstance(model[0], nn.Linear)
