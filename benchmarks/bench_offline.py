"""Offline throughput: pdserve's engine vs Hugging Face transformers `generate`, same model, same prompts,
same machine, one run. Prints prompt and generated tokens/s for both and the ratio.

    python benchmarks/bench_offline.py --num-prompts 32 --input-len 128 --output-len 64
    python benchmarks/bench_offline.py --hf-batch-size 32 --rounds 3   # alternating rounds, per-round ratios

With `--rounds N` both sides are measured N times in alternating order (pdserve first in even rounds) and
each round's ratio is printed with the load average before it and both sides' CPU seconds: on a shared
machine the load moves, and a round's two halves see nearly the same load. `--hf-threads` sets the torch
threads of transformers' side (default: torch's default, as it is usually run); pdserve uses its own
per-step thread counts (PDSERVE_CPU_THREADS).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Avoid the first ids (special tokens in most vocabularies).
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def make_pdserve(model_dir: str, args):
    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig
    from pdserve.types.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=args.max_num_seqs,
                                    enable_prefix_caching=False))
    engine.add_request("warm", list(range(100, 116)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return engine


def bench_pdserve(engine, prompts, output_len: int, rnd: int) -> tuple[float, float, int]:
    from pdserve.types.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(f"{rnd}-{i}", p, params)
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
    return time.perf_counter() - t0, time.process_time() - c0, generated


def make_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        model.generate(torch.tensor([list(range(100, 116))]), max_new_tokens=2, do_sample=False)
    return model


def bench_hf(model, prompts, output_len: int, batch_size: int, threads: int) -> tuple[float, float, int]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    generated = 0
    try:
        with torch.no_grad():
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(0, len(prompts), batch_size):
                batch = torch.tensor(prompts[i : i + batch_size])  # equal lengths: no padding needed
                out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                                     min_new_tokens=output_len, do_sample=False, pad_token_id=0)
                generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
            return time.perf_counter() - t0, time.process_time() - c0, generated
    finally:
        torch.set_num_threads(before)


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
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--hf-threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()

    from pdserve.engine.engine import resolve_model_dir
    from pdserve.model.config import load_model_config

    model_dir = str(resolve_model_dir(args.model))
    cfg = load_model_config(model_dir)
    prompts = make_prompts(cfg.vocab_size, args.num_prompts, args.input_len, args.seed)
    n_prompt = args.num_prompts * args.input_len
    engine = make_pdserve(model_dir, args)
    hf = make_hf(model_dir)

    print(f"model={model_dir} prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
          f"hf_batch={args.hf_batch_size} hf_threads={args.hf_threads} pdserve_threads=({engine.runner.cpu_threads})")
    print(f"{'round':>5} {'load':>5} {'':12} {'wall s':>8} {'cpu s':>7} {'prompt tok/s':>13} {'gen tok/s':>10} "
          f"{'total tok/s':>12}")
    ratios = []
    for rnd in range(args.rounds):
        load = os.getloadavg()[0]
        sides = {}
        for name in (("pdserve", "transformers") if rnd % 2 == 0 else ("transformers", "pdserve")):
            if name == "pdserve":
                sides[name] = bench_pdserve(engine, prompts, args.output_len, rnd)
            else:
                sides[name] = bench_hf(hf, prompts, args.output_len, args.hf_batch_size, args.hf_threads)
        for name in ("pdserve", "transformers"):
            s, cpu, gen = sides[name]
            assert gen == args.num_prompts * args.output_len, (name, gen)
            print(f"{rnd:>5} {load:>5.1f} {name:12} {s:8.2f} {cpu:7.2f} {n_prompt / s:13.1f} {gen / s:10.1f} "
                  f"{(n_prompt + gen) / s:12.1f}")
        ratios.append(sides["transformers"][0] / sides["pdserve"][0])
        print(f"{rnd:>5} ratio (pdserve / transformers, total tokens/s): {ratios[-1]:.2f}x "
              f"(CPU seconds transformers / pdserve: {sides['transformers'][1] / sides['pdserve'][1]:.2f}x)", flush=True)
    print(f"median ratio over {args.rounds} round(s): {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
