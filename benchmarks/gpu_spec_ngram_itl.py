"""Decode time per output token with and without ngram speculation on the GPU (issue 42), 8B shape with dummy
weights, on a repetitive prompt set:

    python benchmarks/gpu_spec_ngram_itl.py --model Llama-3.1-8B --batch 1,4 --k 4 --max-tokens 96

Prompts: a random segment of `--segment` tokens repeated to `--prompt-len` (what ngram's prompt lookup is
for: code edits, quoting a document; a dummy-weight model's greedy output also tends to loop, which the
lookup finds in the output itself). Three runs per batch size, greedy, ignore_eos, same prompts:
- plain: an engine without speculation, as users run it (decode CUDA graphs, async scheduling);
- ngram graph: an engine with `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
  "prompt_lookup_max": 3}`, its verify steps replayed from the verify CUDA graphs;
- ngram eager: the same engine with the verify graphs switched off at run time (the step before issue 42).
Reported per run: TPOT (per request (last token time - first token time) / (tokens - 1), the median over the
requests: what ITL is per token; with speculation several tokens arrive at once, so arrival gaps are not
comparable), decode steps, the acceptance (accepted / drafted) and tokens per verify step; outputs must be
token-identical across the three runs ("MISMATCH" otherwise). The two engines are built one after the other
(`--blocks` KV blocks each) in one process.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from gpu_spec_verify_cost import simulate_graphs


def prompts_for(batch: int, vocab: int, segment: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        seg = torch.randint(100, vocab, (segment,), generator=g).tolist()
        out.append((seg * (length // segment + 1))[:length])
    return out


def run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """(tokens per request, median TPOT ms, engine steps) of one batch run to the end."""
    from pdserve.types.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    base = engine.num_finished
    ids = [f"itl{base}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, sp)
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                toks[o.request_id].extend(o.new_token_ids)
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    tpot = statistics.median((last[r] - first[r]) / (len(toks[r]) - 1) * 1e3 for r in ids)
    return [toks[r] for r in ids], tpot, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--simulate-graphs", action="store_true",
                    help="CPU check of the script: the GPU step path with its graphs simulated (torch attention)")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--segment", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each kind per batch; the median TPOT is reported")
    args = ap.parse_args()

    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig

    batches = [int(b) for b in args.batch.split(",")]
    common = dict(model=args.model, load_format=args.load_format, device=args.device, max_num_seqs=max(batches),
                  max_model_len=args.prompt_len + args.max_tokens + 2 * args.k + 16,
                  num_gpu_blocks_override=args.blocks)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    results: dict[tuple[str, int], list] = {}

    plain = LLMEngine(EngineConfig(**common))
    if args.simulate_graphs:
        simulate_graphs(plain.runner)
    vocab = plain.model_cfg.vocab_size
    for b in batches:
        ps = prompts_for(b, vocab, args.segment, args.prompt_len, seed=b)
        run(plain, ps, 8)  # warm-up
        results[("plain", b)] = [run(plain, ps, args.max_tokens) for _ in range(args.rounds)]
    plain.shutdown()
    del plain
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    eng = LLMEngine(EngineConfig(speculative_config=spec, **common))
    if args.simulate_graphs:
        simulate_graphs(eng.runner)
    gpu = eng.runner.gpu
    print(f"{args.model} ({args.load_format}), K = {args.k}, prompts {args.prompt_len} tokens (a {args.segment}-token "
          f"segment repeated), {args.max_tokens} new tokens, verify graphs "
          f"{gpu.verify_graphs if gpu is not None else None}")
    acc: dict[tuple[str, int], tuple[int, int, int, int]] = {}
    for b in batches:
        ps = prompts_for(b, vocab, args.segment, args.prompt_len, seed=b)
        for name, on in (("ngram graph", True), ("ngram eager", False)):
            if gpu is not None:
                gpu.verify_graphs_on = on
            run(eng, ps, 8)
            s0 = eng.stats().spec_decode
            g0 = gpu.verify_graph_steps if gpu is not None else 0
            results[(name, b)] = [run(eng, ps, args.max_tokens) for _ in range(args.rounds)]
            s1 = eng.stats().spec_decode
            acc[(name, b)] = (s1.num_accepted_tokens - s0.num_accepted_tokens,
                              s1.num_draft_tokens - s0.num_draft_tokens, s1.num_drafts - s0.num_drafts,
                              (gpu.verify_graph_steps if gpu is not None else 0) - g0)
    eng.shutdown()

    print("| batch | run | TPOT ms (median of rounds) | speedup vs plain | decode steps | accepted / drafted "
          "| tokens per verify step | verify graph steps | tokens as plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        base_toks = results[("plain", b)][0][0]
        base_tpot = statistics.median(r[1] for r in results[("plain", b)])
        for name in ("plain", "ngram graph", "ngram eager"):
            rs = results[(name, b)]
            tpot = statistics.median(r[1] for r in rs)
            same = all(r[0] == base_toks for r in rs)
            if name == "plain":
                extra = "- | - | - |"
            else:
                a, d, n, gsteps = acc[(name, b)]
                per_step = (a + n) / n if n else 0.0  # accepted drafts plus the verify step's own token
                extra = f"{a} / {d} ({100 * a / max(d, 1):.0f} %) | {per_step:.2f} | {gsteps} |"
            print(f"| {b} | {name} | {tpot:.2f} | {base_tpot / tpot:.2f}x | {rs[0][2]} | {extra} "
                  f"{'yes' if same else 'MISMATCH'} |", flush=True)


if __name__ == "__main__":
    main()
