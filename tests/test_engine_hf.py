"""Greedy output must be token-identical to Hugging Face transformers, in every scheduling regime."""

from __future__ import annotations

import pytest
from engine_utils import hf_greedy, make_engine, mixed_prompts, run_engine
from tiny_models import VOCAB

from pdserve.types.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def assert_accounting_clean(engine) -> None:
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(c == 0 for c in engine.blocks.ref_cnt)
    assert not engine.requests and not engine.num_held


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batch_matches_transformers(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    prompts = mixed_prompts(VOCAB)
    engine = make_engine(model)
    assert run_engine(engine, prompts, GREEDY) == hf_greedy(model, prompts, 16)
    assert_accounting_clean(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_repetition_penalty_matches_transformers(tiny_model_factory, arch):
    """HF's RepetitionPenaltyLogitsProcessor penalises every token of the prompt and of the output so far, as
    the engine does; chunked prefill and a mixed batch (penalised rows beside plain ones) change nothing."""
    model = tiny_model_factory(arch)
    prompts = mixed_prompts(VOCAB, seed=11)
    penalised = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    expect = hf_greedy(model, prompts, 24, repetition_penalty=1.3)
    assert run_engine(make_engine(model), prompts, penalised) == expect
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, max_num_batched_tokens=16, block_size=4)
    mixed = run_engine(engine, prompts, [penalised if i % 2 else plain for i in range(len(prompts))])
    unpenalised = hf_greedy(model, prompts, 24)
    assert mixed == [expect[i] if i % 2 else unpenalised[i] for i in range(len(prompts))]
    assert expect != unpenalised  # the penalty changes these outputs: the comparison above can fail
    assert_accounting_clean(engine)


def test_tied_embeddings_and_llama3_rope(tiny_model_factory):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    model = tiny_model_factory("llama", tie=True, rope_scaling=rope)
    prompts = mixed_prompts(VOCAB, seed=3, lengths=(70, 9))
    engine = make_engine(model)
    assert run_engine(engine, prompts, GREEDY) == hf_greedy(model, prompts, 16)


def test_prefix_cache_hits_are_exact(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8)
    shared = mixed_prompts(VOCAB, seed=5, lengths=(41,))[0]
    first = [shared + [7, 8, 9]]
    second = [shared + [10, 11], shared + [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    assert run_engine(engine, first, GREEDY) == hf_greedy(tiny_llama, first, 16)
    hits_before = engine.blocks.prefix_hits
    assert run_engine(engine, second, GREEDY) == hf_greedy(tiny_llama, second, 16)
    assert engine.blocks.prefix_hits - hits_before >= 2 * 40  # five full 8-token blocks per prompt
    assert_accounting_clean(engine)


def test_cpu_default_blocks_of_128_in_a_head_major_pool_are_exact(tiny_llama):
    """The CPU defaults (vLLM's): blocks of 128 tokens, each (layer, K|V) region head-major; prompts over
    several blocks, chunked, decoding across a block boundary, and a two-block prefix-cache hit."""
    from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT

    engine = make_engine(tiny_llama, block_size=None, num_gpu_blocks_override=24, max_num_batched_tokens=100)
    runner = engine.runner
    assert engine.config.block_size == runner.block_size == 128 and runner.layout == HEAD_MAJOR_LAYOUT
    _, layers, _, heads, tokens, dim = runner.kv_pool.shape
    assert (heads, tokens) == (runner.num_kv_heads, 128) and runner.kv_pool.is_contiguous()
    assert runner.kv_cache.shape == (runner.num_blocks, layers, 2, 128, heads, dim)
    shared = mixed_prompts(VOCAB, seed=11, lengths=(260,))[0]
    prompts = [shared + [5, 6], mixed_prompts(VOCAB, seed=12, lengths=(120,))[0], [9, 10, 11]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)  # 120 + 20 crosses 128
    assert run_engine(engine, prompts, params) == hf_greedy(tiny_llama, prompts, 20)
    hits_before = engine.blocks.prefix_hits
    again = [shared + [7, 8, 9]]
    assert run_engine(engine, again, params) == hf_greedy(tiny_llama, again, 20)
    assert engine.blocks.prefix_hits - hits_before >= 256
    assert_accounting_clean(engine)


def test_tiny_chunked_prefill_is_exact(tiny_llama):
    engine = make_engine(tiny_llama, max_num_batched_tokens=5, block_size=4)
    prompts = mixed_prompts(VOCAB, seed=7)
    assert run_engine(engine, prompts, GREEDY) == hf_greedy(tiny_llama, prompts, 16)
    assert_accounting_clean(engine)


def test_preemption_by_recompute_is_exact(tiny_llama):
    # 12 blocks of 4 tokens cannot hold six growing sequences at once: the scheduler must preempt.
    engine = make_engine(tiny_llama, num_gpu_blocks_override=12, block_size=4, enable_prefix_caching=False)
    prompts = mixed_prompts(VOCAB, seed=9, lengths=(6, 9, 12, 5, 7, 10))
    assert run_engine(engine, prompts, GREEDY) == hf_greedy(tiny_llama, prompts, 16)
    assert engine.scheduler.num_preemptions > 0
    assert_accounting_clean(engine)


def test_prompt_too_long_fails_alone(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=64)
    from pdserve.engine.engine import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        engine.add_request("too-long", list(range(3, 80)), GREEDY)
    prompts = mixed_prompts(VOCAB, seed=1, lengths=(10,))
    assert run_engine(engine, prompts, GREEDY) == hf_greedy(tiny_llama, prompts, 16)
    assert_accounting_clean(engine)


def test_out_of_vocab_token_rejected(tiny_llama):
    from pdserve.types.sampling_params import ParamError

    engine = make_engine(tiny_llama)
    with pytest.raises(ParamError, match="out of vocabulary"):
        engine.add_request("bad", [1, 2, VOCAB + 5], GREEDY)
    assert_accounting_clean(engine)


def test_max_model_len_caps_generation(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=24)
    out = run_engine(engine, [list(range(3, 20))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(out[0]) == 24 - 17


def test_smollm2_default_matches_transformers():
    """The embedded default (SmolLM2-135M-Instruct, converted from its GGUF) on chat and completion prompts."""
    pytest.importorskip("gguf")
    from pdserve.model.default_model import resolve_model
    from pdserve.text.tokenizer import load_tokenizer

    try:
        model = resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(str(model))
    texts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        tok.apply_chat_template([{"role": "system", "content": "You answer in one word."},
                                 {"role": "user", "content": "Name a fruit."}]),
        "The three primary colours are",
        "def fibonacci(n):",
    ]
    prompts = [tok.encode(t) for t in texts]
    engine = make_engine(model, max_model_len=512)
    assert run_engine(engine, prompts, GREEDY) == hf_greedy(model, prompts, 16)
    assert_accounting_clean(engine)


def test_warm_up_leaves_the_engine_as_new_and_exact(tiny_llama):
    """The GPU start-up warm-up (run here on the CPU): no request, block or counter left behind, and a
    prompt sharing the warm-up's prefix (a prefix-cache hit on its blocks) still matches transformers."""
    free = make_engine(tiny_llama, block_size=4).blocks.num_free_blocks
    engine = make_engine(tiny_llama, block_size=4, warm_up=True)
    assert not engine.has_unfinished() and not engine.scheduler.has_work()
    assert engine.num_finished == 0 and engine.blocks.prefix_queries == 0
    assert engine.blocks.num_free_blocks == free
    prompts = [list(range(1, 15)), [5, 6, 7, 8, 9]]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert run_engine(engine, prompts, greedy) == hf_greedy(tiny_llama, prompts, 6)
    assert engine.blocks.prefix_hits > 0


def test_long_chunks_of_steps_without_decode_rows_are_token_exact(tiny_llama):
    """prefill_only_chunk_tokens: long prompts prefilled in chunks longer than the budget while nothing
    decodes (the first), interleaved with budget-sized chunks once requests decode: same tokens as HF."""
    prompts = mixed_prompts(320, seed=21, lengths=(230, 150, 9))
    engine = make_engine(tiny_llama, max_num_batched_tokens=32, prefill_only_chunk_tokens=96, max_model_len=512)
    assert make_engine(tiny_llama).scheduler.prefill_only_chunk_tokens == 0  # off on CPU by default
    sizes: list[int] = []
    real = engine.scheduler.schedule

    def schedule():
        out = real()
        sizes.append(out.num_tokens)
        return out

    engine.scheduler.schedule = schedule
    got = run_engine(engine, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert got == hf_greedy(tiny_llama, prompts, 8)
    assert sizes[:3] == [96, 96, 38]  # the first prompt alone in long chunks (230 = 96 + 96 + 38)
