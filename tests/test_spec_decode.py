"""Speculative decoding (pdserve.engine.spec_decode): ngram drafts, the rejection sampler, and the engine
giving the same tokens as without speculation at every acceptance length."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import hf_greedy, make_engine, mixed_prompts, run_engine

from pdserve.engine.request import Request
from pdserve.engine.runner.sampler import Sampler
from pdserve.engine.spec_decode.ngram import propose_ngram
from pdserve.engine.spec_decode.rejection import verify
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts whose continuation a tiny random model tends to copy: drafts get accepted."""
    return [[5, 6, 7, 8, 9, 10, 11] * 6, list(range(20, 60)) * 2, [3, 4] * 20, [vocab - 1, 17, 90] * 9]


# ---- the proposer -----------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_earliest_match():
    t = np.array([1, 2, 3, 4, 2, 3])
    assert propose_ngram(t, 4, 2, 3) == [4, 2, 3]  # vLLM's docstring example: [2, 3] matched, 3 tokens left
    assert propose_ngram(t, 2, 2, 3) == [4, 2]
    assert propose_ngram(np.array([9, 1, 2, 7, 1, 2, 8, 5, 1, 2]), 2, 1, 2) == [7, 1]  # earliest of equal length
    assert propose_ngram(np.array([1, 2, 3, 9, 2, 3, 5, 1, 2, 3]), 2, 1, 3) == [9, 2]  # the longest wins
    assert propose_ngram(np.array([1, 2, 3, 4]), 3, 1, 3) == []  # nothing repeats
    assert propose_ngram(np.array([7, 7, 7]), 3, 1, 2) == [7]  # the match may overlap the suffix
    assert propose_ngram(np.array([1, 2, 1]), 3, 2, 2) == []  # shorter than prompt_lookup_min


def test_config_takes_vllms_json_and_refuses_the_rest():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (5, 5, 3)  # vLLM's defaults
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None
    c = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 2})
    assert (c.method, c.model) == ("draft_model", "/some/draft")
    for bad, words in (({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "eagle", "num_speculative_tokens": 2}, "not available"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "draft's folder"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
                        "disable_by_batch_size")):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


# ---- the rejection sampler, statistically -----------------------------------------------------------------
def _request(i: int, drafts: list[int], **params) -> Request:
    req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=10, **params), frozenset(), 1000)
    req.output_token_ids = [4]
    req.spec_token_ids = list(drafts)
    return req


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's chi-square against `probs` below the 0.999 quantile (Wilson-Hilferty approximation)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    exp = n * probs[keep]
    chi2 = float(((counts[keep] - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # the 0.999 quantile of N(0, 1)
    limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return chi2 < limit


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
                                    {"temperature": 1.0, "top_k": 3}])
def test_rejection_sampling_emits_the_target_distribution(params):
    """With one-hot (ngram) drafts, the emitted tokens are distributed as the target's, whatever the drafts:
    position 0 always, position 1 given the first draft was accepted (then its own target row)."""
    vocab, n = 6, 6000
    torch.manual_seed(0)
    row0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    row1 = torch.tensor([0.0, 2.0, -0.5, 1.0, 0.3, -2.0])
    row2 = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 3.0])
    drafts = [[0, 1], [3, 3], [5, 2]]  # a likely, an unlikely, a middling first draft
    reqs = [_request(i, drafts[i % 3], **params) for i in range(n)]
    logits = torch.stack([row0, row1, row2] * n)
    out = verify(Sampler(seed=1), logits, reqs)
    probs = [Sampler.probs(r[None], [reqs[0]])[0] for r in (row0, row1)]
    probs = [(p / p.sum()).numpy() for p in probs]
    first = np.bincount([v.token_ids[0] for v in out], minlength=vocab)
    assert _chi2_ok(first, probs[0])
    for d in (0, 5):  # given the first draft accepted, the next token follows row 1 (with or without a draft)
        second = np.bincount([v.token_ids[1] for v in out if v.req.spec_token_ids[0] == d and v.num_accepted >= 1],
                             minlength=vocab)
        assert second.sum() > 300 and _chi2_ok(second, probs[1])
    for v in out:  # accepted drafts are a prefix of the drafts, then one token of the target's
        assert v.token_ids[: v.num_accepted] == v.req.spec_token_ids[: v.num_accepted]
        assert len(v.token_ids) == v.num_accepted + 1


def test_greedy_verification_accepts_while_the_argmax_agrees():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 6, 1, 2]):
        logits[row, best] = 5.0
    req = _request(0, [3, 6, 0], temperature=0.0, logprobs=2)
    (v,) = verify(Sampler(), logits, [req])
    assert v.token_ids == [3, 6, 1] and v.num_accepted == 2
    lps = torch.log_softmax(logits, dim=-1)
    assert [lp.token_id for lp in v.logprobs] == [3, 6, 1]
    assert [round(lp.logprob, 5) for lp in v.logprobs] == [round(float(lps[j, t]), 5) for j, t in enumerate([3, 6, 1])]
    req = _request(1, [3, 6, 1], temperature=0.0)
    (v,) = verify(Sampler(), logits, [req])
    assert v.token_ids == [3, 6, 1, 2] and v.num_accepted == 3  # all accepted: the bonus token too


# ---- the engine -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tiny_llama):
    return make_engine(tiny_llama)


@pytest.fixture(scope="module")
def spec(tiny_llama):
    return make_engine(tiny_llama, speculative_config=NGRAM)


def test_greedy_matches_the_engine_without_speculation_and_transformers(tiny_llama, plain, spec):
    prompts = mixed_prompts(320) + repetitive_prompts(320)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    before = spec.stats().spec_decode.num_accepted_tokens
    want = run_engine(plain, prompts, sp)
    assert run_engine(spec, prompts, sp) == want
    assert want == hf_greedy(tiny_llama, prompts, 40)
    s = spec.stats().spec_decode
    assert s.num_accepted_tokens - before > 20  # drafts were accepted: the check covers verify steps
    assert all(a >= b for a, b in zip(s.num_accepted_tokens_per_pos, s.num_accepted_tokens_per_pos[1:], strict=False))


def test_every_max_tokens_stop_token_and_logprobs_as_without_speculation(plain, spec):
    """Each acceptance length ends a request where a plain run ends it: max_tokens anywhere inside a run of
    accepted drafts, a stop token among them, min_tokens and penalties seeing the drafts before them."""
    prompts = repetitive_prompts(320)
    full = run_engine(plain, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    cases = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 2, 3, 5, 7, 11)]
    cases += [SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[out[k]]) for out in full[:2]
              for k in (2, 9)]
    cases += [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4),
              SamplingParams(max_tokens=16, temperature=0, min_tokens=8, stop_token_ids=[full[0][3]]),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)]
    for sp in cases:
        assert run_engine(spec, prompts, sp) == run_engine(plain, prompts, sp), sp
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    a = _logprobs(plain, prompts[0], sp)
    b = _logprobs(spec, prompts[0], sp)
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [x[1] for x in a] == pytest.approx([x[1] for x in b], abs=1e-4)
    assert [x[2] for x in a] == [x[2] for x in b]


def _logprobs(engine, prompt, sp):
    rid = f"lp-{engine.num_finished}"
    engine.add_request(rid, prompt, sp)
    got = []
    for _ in range(200):
        for o in engine.step():
            got.extend((lp.token_id, lp.logprob, [t for t, _ in lp.top]) for lp in o.new_logprobs)
        if not engine.has_unfinished():
            return got
    raise AssertionError("did not finish")


def test_tiny_pool_drops_drafts_and_preempts_exactly(tiny_llama, plain):
    """A pool too small for every request's drafts: drafts are dropped (never preempt), preempted requests
    recompute, and the tokens stay those of a plain run."""
    eng = make_engine(tiny_llama, speculative_config=NGRAM, num_gpu_blocks_override=12, max_num_seqs=8)
    prompts = repetitive_prompts(320) + mixed_prompts(320, lengths=(30, 45))
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    assert run_engine(eng, prompts, sp) == run_engine(plain, prompts, sp)
    assert eng.stats().num_preemptions > 0 and eng.stats().spec_decode.num_accepted_tokens > 0


def test_prefix_cache_holds_only_accepted_tokens(plain, spec):
    """Blocks filled by verify steps are cached under their accepted tokens' hashes, with their KV: a later
    prompt that extends prompt + answer hits them and continues exactly."""
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompt = repetitive_prompts(320)[1][:50]
    answer = run_engine(spec, [prompt], sp)[0]
    assert answer == run_engine(plain, [prompt], sp)[0]
    longer = prompt + answer[:40] + [7]
    hits = spec.stats().prefix_cache_hits
    assert run_engine(spec, [longer], sp) == run_engine(plain, [longer], sp)
    assert spec.stats().prefix_cache_hits - hits >= 80  # blocks past the prompt: written by verify steps


def test_disable_by_batch_size_turns_speculation_off_above_it(tiny_llama, plain):
    eng = make_engine(tiny_llama, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    prompts = repetitive_prompts(320)[:3]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eng.add_request("a", prompts[0], sp)
    eng.add_request("b", prompts[1], sp)
    eng.add_request("c", prompts[2], sp)
    for _ in range(3):  # three running: nobody drafts
        eng.step()
    assert eng.stats().spec_decode.num_drafts == 0
    while eng.has_unfinished():
        eng.step()
    assert run_engine(eng, prompts[:1], sp) == run_engine(plain, prompts[:1], sp)
    assert eng.stats().spec_decode.num_drafts > 0  # one running: it drafts


def test_seeded_sampling_repeats_and_keeps_its_distribution(tiny_llama, plain, spec):
    """Seeded requests repeat run to run with speculation; and over many seeds the second and third
    tokens (where verify steps emit) are distributed as without speculation (two-sample chi-square)."""
    prompt = repetitive_prompts(320)[2]
    sp = [SamplingParams(max_tokens=4, temperature=0.8, top_k=3, seed=s, ignore_eos=True) for s in range(300)]
    a = run_engine(spec, [prompt] * 300, sp)
    assert a[:20] == run_engine(spec, [prompt] * 20, sp[:20])
    b = run_engine(plain, [prompt] * 300, [SamplingParams(max_tokens=4, temperature=0.8, top_k=3, seed=1000 + s,
                                                           ignore_eos=True) for s in range(300)])
    assert spec.stats().spec_decode.num_accepted_tokens > 0
    for pos in (1, 2, 3):
        ka = [tuple(x[: pos + 1]) for x in a]
        kb = [tuple(x[: pos + 1]) for x in b]
        cats = sorted(set(ka) | set(kb))
        ca = np.array([ka.count(c) for c in cats], dtype=float)
        cb = np.array([kb.count(c) for c in cats], dtype=float)
        big = (ca + cb) >= 10  # pool rare categories so the chi-square approximation holds
        ca = np.append(ca[big], ca[~big].sum())
        cb = np.append(cb[big], cb[~big].sum())
        keep = (ca + cb) > 0
        ca, cb = ca[keep], cb[keep]
        pooled = (ca + cb) / (ca.sum() + cb.sum())
        probs = pooled
        chi2 = float((((ca - ca.sum() * probs) ** 2) / (ca.sum() * probs)).sum()
                     + (((cb - cb.sum() * probs) ** 2) / (cb.sum() * probs)).sum())
        df = len(ca) - 1
        limit = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3 if df > 0 else 0.0
        assert chi2 <= limit, (pos, chi2, limit)


# ---- a draft model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_draft(tiny_model_factory):
    return tiny_model_factory("llama", seed=7, hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def test_draft_model_greedy_exact_and_its_kv_kept_in_step(tiny_llama, small_draft, plain):
    """The target as its own draft must have every draft accepted: that holds only if the draft's KV (its
    prompt prefill, then the accepted tokens it catches up on) is right at every step, through preemptions
    in a tiny pool too. A different small draft is mostly rejected, with the same tokens."""
    prompts = mixed_prompts(320, lengths=(3, 17, 40)) + repetitive_prompts(320)[:2]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = run_engine(plain, prompts, sp)
    for blocks in (128, 12):
        same = make_engine(tiny_llama, speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 3},
                           num_gpu_blocks_override=blocks, max_num_seqs=8)
        assert run_engine(same, prompts, sp) == want
        s = same.stats().spec_decode
        assert s.num_draft_tokens > 60 and s.num_accepted_tokens == s.num_draft_tokens
        assert blocks == 128 or same.stats().num_preemptions > 0
    other = make_engine(tiny_llama, speculative_config={"model": str(small_draft), "num_speculative_tokens": 3})
    assert run_engine(other, prompts, sp) == want
    assert other.stats().spec_decode.num_draft_tokens > 60


def test_draft_model_must_share_the_vocabulary(tiny_llama, tiny_model_factory):
    wrong = tiny_model_factory("llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(tiny_llama, speculative_config={"model": str(wrong), "num_speculative_tokens": 2})


def test_llm_takes_speculative_config(tiny_llama, plain):
    from pdserve.llm import LLM

    llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=16, num_gpu_blocks_override=64,
              speculative_config=NGRAM)
    prompts = repetitive_prompts(320)[:2]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == run_engine(plain, prompts, sp)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_bench_reads_the_acceptance_from_metrics():
    from pdserve.bench.spec_decode import format_spec_block, parse_spec_counters

    def text(drafts, tokens, accepted, per_pos):
        lines = [f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
                 f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {tokens}',
                 f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {n}'
                  for i, n in enumerate(per_pos)]
        return "\n".join(["# HELP x y", *lines, "vllm:num_requests_running 1"])

    assert parse_spec_counters("vllm:num_requests_running 1") is None
    before = parse_spec_counters(text(10, 40, 20, [8, 6, 4, 2]))
    after = parse_spec_counters(text(30, 120, 80, [28, 22, 18, 12]))
    keys = (after - before).result_keys()
    assert keys["spec_decode_acceptance_rate"] == pytest.approx(75.0)
    assert keys["spec_decode_acceptance_length"] == pytest.approx(4.0)
    assert keys["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.8, 0.7, 0.5])
    assert (keys["spec_decode_num_drafts"], keys["spec_decode_draft_tokens"], keys["spec_decode_accepted_tokens"]) \
        == (20, 80, 60)
    assert "Acceptance rate (%):" in format_spec_block(keys)
    assert (before - before).result_keys() == {}


def test_serve_flags_are_checked_before_loading():
    import argparse

    from pdserve.server.cli import _check_args, add_arguments, engine_config

    def check(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return p.parse_args(list(argv))

    args = check("--speculative-config", json_ngram := '{"method": "ngram", "num_speculative_tokens": 3}',
                 "--speculative-disable-by-batch-size", "4")
    assert _check_args(args) is None
    assert engine_config(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 3,
                                                      "disable_by_batch_size": 4}
    assert "not valid JSON" in _check_args(check("--speculative-config", "{nope"))
    assert "--speculative-config.num_speculative_tokens" in _check_args(
        check("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'))
    assert "needs --speculative-config" in _check_args(check("--speculative-disable-by-batch-size", "4"))
    assert "disable_by_batch_size" in _check_args(check("--speculative-config", json_ngram,
                                                        "--speculative-disable-by-batch-size", "0"))


def test_up_gives_the_speculative_config_to_decode_and_collocated_instances():
    import argparse

    from pdserve.launch.cli import add_arguments, config_from_args
    from pdserve.launch.config import parse_topology
    from pdserve.launch.spec import build_deployment

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    for topology, roles in (("1p1d", {"prefill": False, "decode": True}), ("collocated:1", {"collocated": True})):
        cfg = config_from_args(parser.parse_args(["m", "--gpus", "none", "--speculative-config", spec]))
        cfg.topology = parse_topology(topology)
        for inst in build_deployment(cfg, cpus=[0, 1], env={}).instances:
            has = "--speculative-config" in inst.argv
            assert has == roles[inst.role], inst.name
            if has:
                assert inst.argv[inst.argv.index("--speculative-config") + 1] == spec


def test_a_seeded_request_without_drafts_draws_as_a_plain_step():
    """In verify steps, a seeded request that has no drafts takes the tokens the plain sampler would give it,
    step after step, so batching it with drafting requests does not change its output."""
    torch.manual_seed(3)
    reqs = [_request(0, [], temperature=0.9, top_p=0.8, seed=11), _request(1, [5, 7], temperature=0.7),
            _request(2, [], temperature=1.0, seed=12)]
    twins = [_request(0, [], temperature=0.9, top_p=0.8, seed=11), _request(2, [], temperature=1.0, seed=12)]
    spec, plain = Sampler(seed=0), Sampler(seed=0)
    for _ in range(3):
        logits = torch.randn(5, 40)  # rows: 1 + 3 + 1
        out = verify(spec, logits, reqs)
        want, _ = plain.sample(logits[[0, 4]], twins)
        assert [out[0].token_ids[0], out[2].token_ids[0]] == want


def test_ngram_with_tensor_parallelism(tiny_llama, plain):
    """Rank 0 drafts and verifies; the other ranks replay the verify step's inputs like any other step."""
    prompts = repetitive_prompts(320)[:2]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eng = make_engine(tiny_llama, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        assert run_engine(eng, prompts, sp) == run_engine(plain, prompts, sp)
        assert eng.stats().spec_decode.num_accepted_tokens > 0
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="tensor parallelism"):
        make_engine(tiny_llama, tensor_parallel_size=2,
                    speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 2})


def test_gpu_step_path_verifies_eagerly_between_graph_steps(tiny_llama, plain):
    """The GPU step runner (its decode graphs simulated on the CPU): steps without drafts replay graphs, verify
    steps run eagerly with the drafts as query tokens; tokens as without speculation."""
    from test_async_scheduling import simulate_gpu_path

    eng = simulate_gpu_path(make_engine(tiny_llama, speculative_config=NGRAM, max_num_seqs=4))
    assert eng.pipeline is None  # no async scheduling with speculation
    prompts = repetitive_prompts(320)[:2] + mixed_prompts(320, lengths=(20,))
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    assert run_engine(eng, prompts, sp) == run_engine(plain, prompts, sp)
    assert eng.stats().spec_decode.num_accepted_tokens > 0 and eng.runner.step_timing.graph_steps > 0
