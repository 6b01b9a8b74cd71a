"""Offline throughput: pdserve's engine vs Hugging Face transformers `generate`, same model, same prompts,
same machine, one run. Prints prompt and generated tokens/s for both and the ratio.

    python benchmarks/bench_offline.py --num-prompts 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import time

import torch


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Avoid the first ids (special tokens in most vocabularies).
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def bench_pdserve(model_dir: str, prompts, output_len: int, args) -> tuple[float, int]:
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=args.max_num_seqs,
                                    enable_prefix_caching=False))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # warm-up
    engine.add_request("warm", prompts[0][:16], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
    return time.perf_counter() - t0, generated


def bench_hf(model_dir: str, prompts, output_len: int, batch_size: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generated = 0
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i : i + batch_size])  # equal lengths: no padding needed
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return time.perf_counter() - t0, generated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or short name (default: smollm2-135m)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=1,
                    help="transformers generate batch size (1 = how most people call it; try 32 too)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from pdserve.engine.engine import resolve_model_dir
    from pdserve.model.config import load_model_config

    model_dir = str(resolve_model_dir(args.model))
    cfg = load_model_config(model_dir)
    prompts = make_prompts(cfg.vocab_size, args.num_prompts, args.input_len, args.seed)
    n_prompt = args.num_prompts * args.input_len

    ours_s, ours_gen = bench_pdserve(model_dir, prompts, args.output_len, args)
    hf_s, hf_gen = bench_hf(model_dir, prompts, args.output_len, args.hf_batch_size)
    assert ours_gen == hf_gen == args.num_prompts * args.output_len, (ours_gen, hf_gen)

    print(f"model={model_dir} prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
          f"threads={torch.get_num_threads()} hf_batch={args.hf_batch_size}")
    print(f"{'':12} {'wall s':>8} {'prompt tok/s':>13} {'gen tok/s':>10} {'total tok/s':>12}")
    for name, s, gen in (("pdserve", ours_s, ours_gen), ("transformers", hf_s, hf_gen)):
        print(f"{name:12} {s:8.2f} {n_prompt / s:13.1f} {gen / s:10.1f} {(n_prompt + gen) / s:12.1f}")
    print(f"ratio (pdserve / transformers, total tokens/s): {hf_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
