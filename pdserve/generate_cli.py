"""`pdserve generate`: offline generation on the engine, no server."""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument("--model", default=None, help="HF model folder or short name (default: smollm2-135m)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message via the chat template")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")


def main(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM
    from pdserve.types.sampling_params import SamplingParams

    # Bad input is one line and exit code 2, checked before the (slow) model load where possible.
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)
    except (ValueError, OSError) as e:  # ModelNotFoundError, ParamError, a device this machine lacks, ...
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    prompts = list(args.prompt)
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = 0
    for prompt, res in zip(args.prompt, results, strict=True):
        out = res.outputs[0]
        n += len(out.token_ids)
        print(f"--- {prompt!r}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s)")
    return 0
