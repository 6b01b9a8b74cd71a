"""Helpers to run the engine to completion and compare with Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               max_steps: int = 10_000) -> list[list[int]]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    base = engine.num_finished
    ids = [f"r{base}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, plist, strict=True):
        engine.add_request(rid, p, sp)
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    assert not engine.has_unfinished(), "engine did not finish within the step bound"
    return [outs[rid] for rid in ids]


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("device", "cpu")
    # the tests' pools, prompts and prefix hits are sized in blocks of 16 (GPU's default; CPU's is 128)
    kw.setdefault("block_size", 16)
    kw.setdefault("num_gpu_blocks_override", 128)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


_HF_CACHE: dict[str, object] = {}


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    """transformers' greedy `generate`; `generate_kwargs` add logits processors (e.g. repetition_penalty)."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _HF_CACHE[key]
    outs = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, **generate_kwargs)
            outs.append(g[0, len(p):].tolist())
    return outs


def mixed_prompts(vocab: int, seed: int = 0, lengths=(3, 17, 40, 64, 5, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
