"""Sampling: seeds reproduce, top-k/top-p/min-p never emit excluded tokens, stop conditions hold, and
penalties, logit_bias and allowed_token_ids change the logits by exactly vLLM's amounts."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_engine, run_engine

from pdserve.engine.request import Request
from pdserve.engine.runner.sampler import Sampler
from pdserve.types.sampling_params import ParamError, SamplingParams


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
     ({"top_p": float("inf")}, "top_p"), ({"presence_penalty": 3}, "presence_penalty"),
     ({"presence_penalty": -2.01}, "presence_penalty"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
     ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"repetition_penalty": -1.0}, "repetition_penalty"), ({"allowed_token_ids": []}, "allowed_token_ids"),
     ({"allowed_token_ids": ["3"]}, "allowed_token_ids"), ({"logit_bias": {"3": 1.0}}, "logit_bias"),
     ({"logit_bias": {3: float("inf")}}, "logit_bias")],
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


# ---- penalties, logit_bias, allowed_token_ids ----------------------------------------------------------
def _seq(params: SamplingParams, prompt: list[int], output: list[int], rid: str = "r") -> Request:
    r = Request(rid, prompt, params, frozenset({99}), 1000)
    r.output_token_ids = list(output)
    return r


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -0.5, 1.0]])
    req = _seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0, 1], output=[3, 3, 4])
    out = Sampler.adjust(logits, [req])
    # prompt tokens 0 and 1 and output tokens 3 and 4 (once, whatever their count); 2 and 5 untouched
    assert out.tolist() == [[1.0, -2.0, 3.0, 0.25, -1.0, 1.0]]
    assert logits.tolist() == [[2.0, -1.0, 3.0, 0.5, -0.5, 1.0]]  # the raw logits are left alone
    # the favourite, a prompt token, loses to the runner-up once divided
    toks, _ = Sampler(0).sample(torch.tensor([[2.0, 1.5]]), [_seq(SamplingParams(temperature=0,
                                                                                  repetition_penalty=1.5), [0], [])])
    assert toks == [1]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 6)
    params = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    out = Sampler.adjust(logits, [_seq(params, prompt=[5, 5], output=[1, 1, 1, 4])])
    assert out.tolist() == [[0.0, -(3 * 0.5) - 0.25, 0.0, 0.0, -0.5 - 0.25, 0.0]]
    # negative values reward repetition by the same amounts
    params = SamplingParams(temperature=0, frequency_penalty=-1.0, presence_penalty=-2.0)
    out = Sampler.adjust(logits, [_seq(params, prompt=[0], output=[2, 2])])
    assert out.tolist() == [[0.0, 0.0, 4.0, 0.0, 0.0, 0.0]]


def test_logit_bias_adds_and_flips_the_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    plain = _seq(SamplingParams(temperature=0), [0], [])
    biased = _seq(SamplingParams(temperature=0, logit_bias={2: 1.5, 3: -0.5}), [0], [])
    assert Sampler.adjust(logits, [biased]).tolist() == [[1.0, 3.0, 3.5, -0.5]]
    assert Sampler(0).sample(logits, [plain])[0] == [1]
    assert Sampler(0).sample(logits, [biased])[0] == [2]
    assert SamplingParams(logit_bias={0: 500, 1: -300.5, 2: 7}).logit_bias == {0: 100.0, 1: -100.0, 2: 7.0}


def test_allowed_token_ids_restrict_draws_and_greedy():
    logits = torch.zeros(1, 50)
    logits[0, 0] = 10.0  # the favourite by far, not allowed
    allowed = [3, 17, 42]
    n = 3000
    reqs = [_seq(SamplingParams(temperature=1.0, allowed_token_ids=allowed), [1], [], f"r{i}") for i in range(n)]
    toks, _ = Sampler(0).sample(logits.expand(n, 50), reqs)
    assert set(toks) == set(allowed)  # only these, and each (equally likely among themselves)
    logits[0, 17] = 0.5
    toks, _ = Sampler(0).sample(logits, [_seq(SamplingParams(temperature=0, allowed_token_ids=allowed), [1], [])])
    assert toks == [17]


def test_nothing_to_adjust_costs_no_copy():
    logits = torch.randn(3, 20)
    reqs = [_seq(SamplingParams(temperature=0), [1], [2]), _seq(SamplingParams(temperature=0.5, top_k=3), [1], []),
            _seq(SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, logit_bias={}), [1], [1])]
    assert Sampler.adjust(logits, reqs) is logits


def test_mixed_batch_adjusts_only_its_own_rows():
    torch.manual_seed(3)
    logits = torch.randn(5, 40)
    reqs = [
        _seq(SamplingParams(temperature=0), [1, 2], [3], "plain"),
        _seq(SamplingParams(temperature=0, repetition_penalty=1.7), [1, 2], [3, 3], "rep"),
        _seq(SamplingParams(temperature=0, logprobs=1), [4], [5], "plain-lp"),
        _seq(SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.5), [6], [7, 7, 8], "freq"),
        _seq(SamplingParams(temperature=0, logit_bias={9: 4.0}, allowed_token_ids=[9, 10, 11]), [6], [], "bias"),
    ]
    out = Sampler.adjust(logits, reqs)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    rep = logits[1].clone()
    for t in (1, 2, 3):
        rep[t] = rep[t] / 1.7 if rep[t] > 0 else rep[t] * 1.7
    assert torch.equal(out[1], rep)
    freq = logits[3].clone()
    freq[7] -= 2 * 1.0 + 0.5
    freq[8] -= 1.0 + 0.5
    assert torch.equal(out[3], freq)
    assert torch.isinf(out[4]).sum() == 40 - 3 and out[4, 9] == logits[4, 9] + 4.0
    toks, lps = Sampler(0).sample(logits, reqs)
    assert toks == out.argmax(-1).tolist()
    assert toks[0] == int(logits[0].argmax()) and toks[4] in (9, 10, 11)
    # logprobs are those of the raw logits, whatever else is in the batch
    assert lps[2].logprob == pytest.approx(float(torch.log_softmax(logits[2], -1)[toks[2]]))


def test_seeded_sampled_row_with_penalties():
    """A seeded row with penalties draws as the same seed does from logits penalised by hand."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.2]])
    penalised = dict(temperature=0.8, seed=11, presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.2)
    by_hand = torch.tensor([[1.0 / 1.2 - 2 * 0.4 - 0.3, 0.5 / 1.2 - 0.4 - 0.3, 0.0, -0.5, 0.2]])
    req = _seq(SamplingParams(**penalised), prompt=[2], output=[0, 0, 1], rid="p")
    assert torch.allclose(Sampler.adjust(logits, [req]), by_hand)
    ref = _seq(SamplingParams(temperature=0.8, seed=11), prompt=[2], output=[0, 0, 1], rid="p")
    a, b, c = Sampler(0), Sampler(5), Sampler(0)
    got = [a.sample(logits, [req])[0][0] for _ in range(200)]
    assert got == [b.sample(by_hand, [ref])[0][0] for _ in range(200)]
    unpenalised = [c.sample(logits, [ref])[0][0] for _ in range(200)]
    assert got != unpenalised  # same noise, different logits: the penalties changed draws
    assert got.count(0) < unpenalised.count(0)


def test_engine_rejects_out_of_vocab_bias_and_allowed_ids(tiny_llama):
    from tiny_models import VOCAB

    engine = make_engine(tiny_llama)
    for params, param in ((SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
                          (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[5, VOCAB + 3]), "allowed_token_ids")):
        with pytest.raises(ParamError, match="out of vocabulary") as e:
            engine.add_request("bad", [1, 2, 3], params)
        assert e.value.param == param
    assert not engine.requests


def test_engine_allowed_token_ids_and_bias(tiny_llama):
    engine = make_engine(tiny_llama)
    allowed = [7, 8, 9, 200]
    [out] = run_engine(engine, [[5, 6, 7]], SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True,
                                                           allowed_token_ids=allowed))
    assert len(out) == 24 and set(out) <= set(allowed) and len(set(out)) > 1
    [out] = run_engine(engine, [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                           logit_bias={123: 100}))
    assert out == [123] * 8
