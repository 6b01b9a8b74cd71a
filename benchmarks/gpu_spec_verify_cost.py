"""What a speculative verify step costs on the GPU against a plain decode step (issue 37's goal: K = 4 within
1.15x of a plain step at low batch), 8B shape with dummy weights:

    python benchmarks/gpu_spec_verify_cost.py --model Llama-3.1-8B --batch 1,4,16 --context 2048 --k 4

For each batch size, B requests are prefilled to `--context` tokens, then timed over `--iters` repetitions
(each rewrites the same KV slots, so the state stays put):
- plain: the engine's decode step (`ModelRunner.execute`: the CUDA graph, greedy argmax on the device);
- plain eager: the same step without the graph (`execute_logits` with one row each + argmax);
- verify: K drafts per request (`execute_logits` with K + 1 rows each: an eager step, as verify steps run
  today) plus the rejection sampler's greedy accept (`spec_decode.rejection.verify`).
The ratio verify / plain is the price of speculation per step: speculation wins when the mean acceptance
length (vllm:spec_decode_* on /metrics, `pdserve bench`) exceeds it. Runs on CPU too (`--device cpu --model
DIR`), which checks the script, not the GPU's numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, iters: int, device: torch.device) -> float:
    """Median ms of fn() over iters calls (after 3 warm-up calls), each ending with a host sync."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()

    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig

    batches = [int(b) for b in args.batch.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                                    max_model_len=args.context + 4 * args.k + 16, max_num_seqs=max(batches)))
    g = torch.Generator().manual_seed(0)
    print(f"{args.model} ({args.load_format}), context {args.context}, K = {args.k}, device {engine.runner.device}")
    print("| batch | plain step (graph) ms | plain step (eager) ms | verify K+1 rows (eager) ms | verify / plain "
          "| verify / plain eager |")
    print("|---|---|---|---|---|---|")
    for b in batches:
        t_plain, t_eager, t_verify = measure(engine, b, args, g)
        print(f"| {b} | {t_plain:.2f} | {t_eager:.2f} | {t_verify:.2f} | {t_verify / t_plain:.2f} | "
              f"{t_verify / t_eager:.2f} |")


def measure(engine, b: int, args: argparse.Namespace, g: torch.Generator) -> tuple[float, float, float]:
    """(plain graph, plain eager, verify) ms for b requests at args.context tokens."""
    from pdserve.engine.spec_decode.rejection import verify
    from pdserve.types.sampling_params import SamplingParams

    runner, vocab = engine.runner, engine.model_cfg.vocab_size
    ids = [f"b{b}-{i}" for i in range(b)]
    for rid in ids:
        engine.add_request(rid, torch.randint(100, vocab, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    for _ in range(10 * b + 100):  # bounded: the prompts' prefill chunks, then each has its first token
        engine.step()
        if all(engine.requests[r].output_token_ids for r in ids):
            break
    reqs = [engine.requests[r] for r in ids]
    for r in reqs:
        assert r.num_computed_tokens == r.num_tokens - 1, "not in the decode phase"
        assert engine.blocks.allocate(r, r.num_tokens + args.k), "the KV pool is too small"
    plain_batch = [(r, 1) for r in reqs]
    t_plain = timed(lambda: runner.execute(plain_batch), args.iters, runner.device)

    def eager_plain():
        _, logits = runner.execute_logits(plain_batch)
        logits.argmax(dim=-1).tolist()

    t_eager = timed(eager_plain, args.iters, runner.device)
    drafts = {r.request_id: torch.randint(100, vocab, (args.k,), generator=g).tolist() for r in reqs}

    def verify_step():
        for r in reqs:
            r.spec_token_ids = list(drafts[r.request_id])
        got, logits = runner.execute_logits([(r, 1 + args.k) for r in reqs])
        verify(runner.sampler, logits, got)
        for r in reqs:
            r.spec_token_ids = []

    t_verify = timed(verify_step, args.iters, runner.device)
    for rid in ids:
        engine.abort_request(rid)
    return t_plain, t_eager, t_verify

if __name__ == "__main__":
    main()
