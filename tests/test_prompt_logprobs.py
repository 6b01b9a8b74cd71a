"""Prompt logprobs (vLLM's `prompt_logprobs`) against transformers' log_softmax, in the engine: whole prompts,
chunked prefill, a prompt whose prefix is cached (it is recomputed), batched with other requests."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_engine, mixed_prompts

from pdserve.types.sampling_params import SamplingParams

TOP = 3


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 log_softmax of transformers' logits (row j predicts token j + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def run(engine, prompts, params):
    got = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"q{engine.num_finished}-{i}", p, sp)
    order = [f"q{engine.num_finished}-{i}" for i in range(len(prompts))]
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in got, "prompt logprobs are sent once"
                got[o.request_id] = o.prompt_logprobs
    return [got.get(rid) for rid in order]


def check(model_dir, prompt, lps, top=TOP):
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert len(lps) == len(prompt) and lps[0] is None
    for j in range(1, len(prompt)):
        lp, row = lps[j], ref[j - 1]
        assert lp.token_id == prompt[j]
        assert abs(lp.logprob - row[prompt[j]].item()) < 1e-4, j
        assert lp.rank == int((row > row[prompt[j]]).sum()) + 1
        vals, ids = torch.topk(row, top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert max((abs(v - r) for (_, v), r in zip(lp.top, vals.tolist(), strict=True)), default=0) < 1e-4


@pytest.mark.parametrize("runner", ["cpu", "gpu_step_runner"])
def test_prompt_logprobs_match_hf_chunked_and_cached(tiny_llama, runner: str):
    """runner gpu_step_runner: the CUDA step path (its HostBatch rows, eager steps, decode graphs simulated)
    run on the CPU."""
    prompts = mixed_prompts(320, lengths=(40, 5, 70))
    # chunks of 24 tokens: the 70-token prompt is computed over three steps, batched with the others
    engine = make_engine(tiny_llama, max_num_batched_tokens=24, enable_chunked_prefill=True)
    if runner == "gpu_step_runner":  # as test_async_scheduling.simulate_gpu_path: torch reference attention
        from pdserve.attention.torch_ref import TorchAttention

        engine.runner.backend = TorchAttention()
        engine.runner.model.fused_ops = None
        engine.runner.use_gpu_step_runner(simulate_graphs=True)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    with_lps = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    got = run(engine, prompts, [with_lps, plain, with_lps])
    check(tiny_llama, prompts[0], got[0])
    assert got[1] is None
    check(tiny_llama, prompts[2], got[2])
    # the same prompt again: its blocks are cached, but a prompt-logprob request computes every position
    hits_before = engine.blocks.prefix_hits
    again = run(engine, [prompts[2]], [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)])[0]
    assert engine.blocks.prefix_hits == hits_before
    check(tiny_llama, prompts[2], again, top=0)
    run(engine, [prompts[2]], [plain])  # without prompt logprobs the same prompt does hit the cache
    assert engine.blocks.prefix_hits > hits_before
    if runner == "gpu_step_runner":
        assert engine.runner.step_timing.graph_steps > 0  # the decode steps took the (simulated) graphs


def test_offline_llm_prompt_logprobs(tiny_llama):
    """vLLM's offline form: SamplingParams(prompt_logprobs=k) -> RequestOutput.prompt_logprobs."""
    from pdserve import LLM

    llm = LLM(model=str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=16,
              num_gpu_blocks_override=64)
    prompt = mixed_prompts(320, seed=3, lengths=(21,))[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0,
                                                                    prompt_logprobs=2), use_tqdm=False)[0]
    check(tiny_llama, prompt, out.prompt_logprobs, top=2)
    assert llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1),
                        use_tqdm=False)[0].prompt_logprobs is None
