"""Sampling: seeds reproduce, top-k/top-p/min-p never emit excluded tokens, stop conditions hold."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_engine, run_engine

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import ParamError, SamplingParams


def _req(params: SamplingParams, rid: str = "r") -> Request:
    return Request(rid, [1, 2, 3], params, frozenset({2}), 1000)


def test_seeded_sampling_reproducible(tiny_llama):
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    a = run_engine(engine, prompts, params)
    b = run_engine(engine, prompts, params)
    assert a == b
    c = run_engine(engine, prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert c != a


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p"])
def test_truncation_never_emits_excluded_tokens(kind):
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    probs = torch.softmax(logits[0], -1)
    order = torch.argsort(probs, descending=True)
    if kind == "top_k":
        params = SamplingParams(temperature=1.0, top_k=5, seed=1)
        allowed = set(order[:5].tolist())
    elif kind == "top_p":
        params = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
        cum = torch.cumsum(probs[order], 0)
        n = int((cum < 0.5).sum()) + 1
        allowed = set(order[:n].tolist())
    else:
        params = SamplingParams(temperature=1.0, min_p=0.2, seed=1)
        allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    sampler = Sampler(0)
    seen = set()
    req = _req(params)
    for _ in range(400):
        tok, _ = sampler.sample(logits, [req])
        seen.add(tok[0])
    assert seen <= allowed
    assert len(seen) > 1 or len(allowed) == 1


def test_logprobs_and_rank():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    sampler = Sampler(0)
    toks, lps = sampler.sample(logits, [_req(SamplingParams(temperature=0, logprobs=2))])
    assert toks == [1]
    lp = lps[0]
    assert lp.rank == 1 and lp.token_id == 1
    expect = torch.log_softmax(logits[0], -1)
    assert lp.logprob == pytest.approx(float(expect[1]))
    assert [t for t, _ in lp.top] == [1, 2]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])  # EOS (2) then stop id 3 are the favourites
    sampler = Sampler(0)
    req = _req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]))
    toks, _ = sampler.sample(logits, [req])
    assert toks == [4]


def test_stop_token_id_and_eos(tiny_llama):
    engine = make_engine(tiny_llama)
    free = run_engine(engine, [[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_at = free[3]
    idx = free.index(stop_at)
    out = run_engine(engine, [[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out == free[: idx + 1]


@pytest.mark.parametrize(
    "kwargs,param",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
     ({"logprobs": 50}, "logprobs"), ({"temperature": float("nan")}, "temperature"),
     ({"top_p": float("inf")}, "top_p")],
)
def test_invalid_params(kwargs, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.6)])
def test_batched_draws_follow_the_truncated_softmax(temperature, top_k, top_p):
    """20k rows sampled in one batch: the frequencies match softmax(logits / T) restricted to the kept
    tokens and renormalised (the sampler's default generator is seeded, so this is deterministic)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.5])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    expect = torch.softmax(logits / temperature, -1)
    order = torch.argsort(expect, descending=True)
    keep = torch.zeros(8, dtype=torch.bool)
    if top_k:
        keep[order[:top_k]] = True
    elif top_p < 1.0:
        n = int((torch.cumsum(expect[order], 0) - expect[order] < top_p).sum())
        keep[order[:n]] = True
    else:
        keep[:] = True
    expect = torch.where(keep, expect, 0.0)
    expect /= expect.sum()
    n = 20_000
    reqs = [_req(params, f"r{i}") for i in range(n)]
    toks, _ = Sampler(0).sample(logits.expand(n, 8), reqs)
    freq = torch.bincount(torch.tensor(toks), minlength=8).float() / n
    assert torch.all(freq[~keep] == 0)
    assert torch.allclose(freq, expect, atol=0.015), (freq, expect)


def test_seeded_row_repeats_whatever_it_is_batched_with():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(0)
    together = Sampler(123)
    a = [alone.sample(logits[1:2], [_req(seeded, "s")])[0][0] for _ in range(20)]
    b = []
    for step in range(20):
        others = [_req(SamplingParams(temperature=1.0), f"o{step}{j}") for j in range(3)]
        toks, _ = together.sample(logits, [others[0], _req(seeded, "s"), others[1], others[2]])
        b.append(toks[1])
    assert a == b
    assert len(set(a)) > 1


def test_greedy_and_sampled_rows_in_one_batch_with_logprobs():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    reqs = [_req(SamplingParams(temperature=0, logprobs=3), "g"),
            _req(SamplingParams(temperature=1.0, top_k=1), "k1"),
            _req(SamplingParams(temperature=2.0, logprobs=0, seed=3), "s")]
    toks, lps = Sampler(0).sample(logits, reqs)
    best = logits.argmax(-1).tolist()
    assert toks[0] == best[0] and toks[1] == best[1]  # top_k=1 is greedy whatever the temperature
    assert lps[1] is None
    full = torch.log_softmax(logits, -1)
    assert [t for t, _ in lps[0].top] == torch.topk(full[0], 3).indices.tolist()
    assert lps[0].rank == 1
    s = lps[2]
    assert s.token_id == toks[2] and s.top == []
    assert s.logprob == pytest.approx(float(full[2, toks[2]]), abs=1e-5)
    assert s.rank == int((full[2] > full[2, toks[2]]).sum()) + 1
