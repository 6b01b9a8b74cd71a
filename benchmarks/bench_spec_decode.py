"""Speculative decoding on the CPU box: per-token decode latency with and without ngram speculation, side by
side in one run, at batch 1, on the embedded model (SmolLM2-135M-Instruct).

    python benchmarks/bench_spec_decode.py --rounds 5 --max-tokens 160   # K = 5, prompt_lookup 1..5
    python benchmarks/bench_spec_decode.py --batch 8          # + throughput at batch 8: plain, ngram, ngram
                                                              #   with disable_by_batch_size=4
    python benchmarks/bench_spec_decode.py --draft-prefill    # + what a draft model's prompt prefill costs a
                                                              #   decode instance, against moving its KV
    python benchmarks/bench_spec_decode.py --verify-cost      # only: what a step of 1 + k rows of one request
                                                              #   costs against a plain one-row step

Both engines live in one process and take turns (A/B/A/B per workload and round), so a load change on the
shared box hits both halves of a round alike; each round's ratio is printed with the load average. The
metric is the decode time per output token (TPOT: (last token - first token) / (tokens - 1)), which is what
ITL means per token: with speculation several tokens arrive per step, so the gap between arrivals is not
comparable. Greedy outputs of the two engines are checked to be identical. Also printed: decode steps per
output token of each engine (the model runs speculation saves, whatever a step costs) and the acceptance.

The default speculative config is the one that measured fastest on this CPU (BENCHMARKS.md, "Speculative
decoding"): K = 5 because a step of 3-6 rows costs no more than a one-row step here (oneDNN's packed linears
stream the weights faster at a few rows than at one), and prompt_lookup_min 1 because an unaccepted draft
then costs nothing, so drafting from any match pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    items: list[str]
    total: float


def load_orders(path):
    with open(path) as f:
        rows = json.load(f)
    orders = []
    for row in rows:
        orders.append(Order(row["id"], row["items"], float(row["total"])))
    return orders


def total_revenue(orders):
    revenue = 0.0
    for order in orders:
        revenue += order.total
    return revenue
'''

DOCUMENT = (
    "The Riverside Library opened in 1921 with a collection of four thousand books. In 1958 the library moved "
    "to a larger building on Elm Street, next to the old train station. The new building had a reading room "
    "with tall windows facing the river. In 1987 a fire damaged the east wing, and more than six hundred books "
    "were lost. The town raised money to restore the wing, and it reopened in 1990 with a children's section. "
    "Today the library lends about ninety thousand items a year and hosts a weekly chess club on Thursdays."
)

WORKLOADS = {
    "code edit": "Rename the function total_revenue to compute_revenue in this code and add nothing else. "
                 "Reply with the full code only.\n\n" + CODE,
    "document quotes": "Document:\n" + DOCUMENT + "\n\nWhere did the library move in 1958, and what happened to "
                       "it in 1987 and in 1990? Answer by quoting the document word for word.",
    "plain chat": "Write a short story about a dragon who learns to cook.",
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 1}


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def make_engine(spec: dict | None, max_num_seqs: int = 8):
    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig

    return LLMEngine(EngineConfig(device="cpu", max_num_seqs=max_num_seqs, speculative_config=spec))


def run_one(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float, int]:
    """Greedy; returns the tokens, TPOT in ms, this process's CPU ms per output token after the first
    (less sensitive than wall time to the other processes on a shared box), and the decode steps that gave
    those tokens (the steps after the first token's)."""
    from pdserve.types.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    out: list[int] = []
    first = last = cpu_first = None
    cpu_last = 0.0
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids:
                last, cpu_last = time.perf_counter(), time.process_time()
                if first is None:
                    first, cpu_first = last, cpu_last
                else:
                    steps += 1
                out.extend(o.new_token_ids)
    assert first is not None and cpu_first is not None and len(out) > 1
    n = len(out) - 1
    return out, (last - first) / n * 1e3, (cpu_last - cpu_first) / n * 1e3, steps


def batch_run(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """Output tokens/s of a batch run to completion."""
    from pdserve.types.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    n = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        n += sum(len(o.new_token_ids) for o in engine.step())
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=0, help="also measure throughput at this batch size")
    ap.add_argument("--draft-prefill", action="store_true")
    ap.add_argument("--k", type=int, default=NGRAM["num_speculative_tokens"])
    ap.add_argument("--lookup", default="1,5", help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--verify-cost", action="store_true", help="only the cost of a verify step by its rows")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lookup.split(","))
    NGRAM.update(num_speculative_tokens=args.k, prompt_lookup_min=lo, prompt_lookup_max=hi)

    from transformers import AutoTokenizer

    from pdserve.model.default_model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    if args.verify_cost:
        verify_cost(tok)
        return
    plain, spec = make_engine(None), make_engine(NGRAM)
    print(f"speculative_config: {NGRAM}")
    for name, text in WORKLOADS.items():
        prompt = chat_ids(tok, text)
        ratios, tp, ts, cpu_ratios, steps = [], [], [], [], (0, 0)
        acc0 = spec.stats().spec_decode
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            order = [(plain, "plain"), (spec, "ngram")] if r % 2 == 0 else [(spec, "ngram"), (plain, "plain")]
            got = {}
            for eng, tag in order:
                got[tag] = run_one(eng, f"{name}-{tag}-{r}", prompt, args.max_tokens)
            assert got["plain"][0] == got["ngram"][0], f"{name}: outputs differ"
            tp.append(got["plain"][1])
            ts.append(got["ngram"][1])
            ratios.append(got["plain"][1] / got["ngram"][1])
            cpu_ratios.append(got["plain"][2] / got["ngram"][2])
            steps = (got["plain"][3], got["ngram"][3])  # the same every round: greedy
            print(f"  {name:16s} round {r}: load {load:5.1f}  plain {got['plain'][1]:6.1f} ms/token  "
                  f"ngram {got['ngram'][1]:6.1f} ms/token  speedup {ratios[-1]:.2f}x  (CPU ms/token "
                  f"{got['plain'][2]:.1f} vs {got['ngram'][2]:.1f}: {cpu_ratios[-1]:.2f}x; {len(got['plain'][0])} tokens "
                  f"in {got['plain'][3]} vs {got['ngram'][3]} decode steps)")
        acc1 = spec.stats().spec_decode
        drafted = acc1.num_draft_tokens - acc0.num_draft_tokens
        accepted = acc1.num_accepted_tokens - acc0.num_accepted_tokens
        drafts = acc1.num_drafts - acc0.num_drafts
        print(f"{name:16s}: median TPOT plain {statistics.median(tp):.1f} ms, ngram {statistics.median(ts):.1f} ms; "
              f"speedup median {statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
              f"in CPU time {statistics.median(cpu_ratios):.2f}x; "
              f"acceptance {100 * accepted / max(drafted, 1):.0f} %, {1 + accepted / max(drafts, 1):.2f} tokens "
              f"per verify step; decode steps plain {steps[0]}, ngram {steps[1]} ({steps[0] / max(steps[1], 1):.2f}x fewer)")
    if args.batch:
        prompts = [chat_ids(tok, f"Write a short story about a {a} who learns to {b}.")
                   for a, b in zip(["dragon", "robot", "cat", "sailor", "baker", "king", "fox", "child"] * 4,
                                   ["cook", "sing", "swim", "paint", "fly", "read", "dance", "count"] * 4,
                                   strict=True)][: args.batch]
        capped = make_engine({**NGRAM, "disable_by_batch_size": max(1, args.batch // 2)})
        rows = {"plain": [], "ngram": [], f"ngram, disable_by_batch_size={max(1, args.batch // 2)}": []}
        for r in range(2):
            for (tag, eng) in zip(rows, (plain, spec, capped), strict=True):
                rows[tag].append(batch_run(eng, prompts, 64, f"b{r}-{tag}"))
        for tag, vals in rows.items():
            print(f"batch {args.batch}: {tag:36s} {statistics.mean(vals):7.1f} output tokens/s "
                  f"(runs {', '.join(f'{v:.1f}' for v in vals)})")
    if args.draft_prefill:
        draft_prefill(tok)


def verify_cost(tok, rounds: int = 12) -> None:
    """The model step of one request verifying k drafts (1 + k query rows: the target's logits after its last
    token and after each draft), and the rejection sampler over those rows, against a plain decode step (one
    row, sampled), at two context lengths. The step sizes take turns within each round; one thread (so this
    process's CPU time is the step's work, not a second thread's spinning); medians of CPU ms per step.
    Then the model's linears alone by rows (what decides the shape of the step's cost)."""
    from pdserve.cpu.threads import StepThreads
    from pdserve.types.sampling_params import SamplingParams

    eng = make_engine(NGRAM)
    eng.runner.cpu_threads = StepThreads(1, 1)
    assert eng.spec is not None
    ks = (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 15)
    for context in (len(chat_ids(tok, WORKLOADS["code edit"])) + 16, 2048):
        prompt = (chat_ids(tok, WORKLOADS["code edit"]) + chat_ids(tok, DOCUMENT) * 64)[:context - 16]
        eng.add_request(f"cost-{context}", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        while len(eng.requests[f"cost-{context}"].output_token_ids) < 16:
            eng.step()
        req = eng.requests[f"cost-{context}"]
        if not eng.blocks.allocate(req, req.num_tokens + max(ks)):  # room for the drafts' K/V
            raise RuntimeError("no free KV blocks for the drafts")
        model: dict[int, list[float]] = {k: [] for k in ks}
        sampler: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(rounds):
            for k in ks:
                req.spec_token_ids = prompt[1 : 1 + k]  # any tokens: only the cost is looked at
                batch = [(req, 1 + k)]
                t0 = time.process_time()
                reqs, logits = eng.runner.execute_logits(batch)
                t1 = time.process_time()
                if k == 0:
                    eng.runner.sampler.sample(logits, reqs)
                else:
                    eng.spec.verify(eng.runner.sampler, logits, reqs)
                t2 = time.process_time()
                req.spec_token_ids = []
                model[k].append(t1 - t0)
                sampler[k].append(t2 - t1)
        eng.abort_request(req.request_id)
        base = statistics.median(model[0]) + statistics.median(sampler[0])
        print(f"context {req.num_tokens} tokens, 1 thread, CPU ms per step (median of {rounds}):")
        for k in ks:
            m, smp = statistics.median(model[k]), statistics.median(sampler[k])
            print(f"  {1 + k:2d} rows (k = {k:2d}): model {m * 1e3:6.1f}  {'sampler' if k == 0 else 'verify '} "
                  f"{smp * 1e3:5.2f}  total {(m + smp) * 1e3:6.1f}  = {(m + smp) / base:.2f}x the plain step")
    linear_cost(eng.runner.model, rounds)


def linear_cost(model, rounds: int, rows: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 9, 16)) -> None:
    """Every linear of one shape (the 30 layers' copies, so their weights stream from memory as in a step)
    called once per round with `rows` input rows; CPU time against one row, medians."""
    import torch

    shapes: dict[tuple[int, int], list] = {}
    for m in model.modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features") and not list(m.children()):
            shapes.setdefault((m.in_features, m.out_features), []).append(m)
    torch.set_num_threads(1)
    print("linears, 1 thread: CPU time by input rows against 1 row (all copies of the shape per call)")
    with torch.inference_mode():
        for (n_in, n_out), mods in shapes.items():
            times: dict[int, list[float]] = {r: [] for r in rows}
            for _ in range(rounds):
                for r in rows:
                    x = torch.randn(r, n_in)
                    t0 = time.process_time()
                    for m in mods:
                        m(x)
                    times[r].append(time.process_time() - t0)
            base = statistics.median(times[1])
            print(f"  {n_in:5d} -> {n_out:5d} x{len(mods):2d}: 1 row {base * 1e3:6.2f} ms; "
                  + "  ".join(f"{r}: {statistics.median(times[r]) / base:.2f}x" for r in rows[1:]))


def draft_prefill(tok) -> None:
    """A decode instance with a draft model computes the draft's prompt KV itself (spec_decode.draft): its
    first proposal for a request runs the draft over the prompt. Timed here for the embedded model as the
    draft (itself as the target too), against moving the same KV at the NIXL rate measured on this box."""
    from pdserve.model.default_model import resolve_model
    from pdserve.types.sampling_params import SamplingParams

    eng = make_engine({"model": str(resolve_model(None)), "num_speculative_tokens": 3})
    proposer = eng.spec.draft
    cfg = proposer.runner.model_cfg
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    for n in (256, 1024):
        prompt = (chat_ids(tok, DOCUMENT * 20) * 10)[:n]
        eng.add_request(f"dp-{n}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        eng.step()  # the target's prefill: the first token
        req = eng.requests[f"dp-{n}"]
        t0 = time.perf_counter()
        proposer.propose([req], [3])  # the draft's prompt prefill + 2 more draft positions
        t1 = time.perf_counter()
        req.draft_computed_tokens = req.num_tokens - 1  # as after one step: catch up on one token only
        proposer.propose([req], [3])
        t2 = time.perf_counter()
        eng.abort_request(f"dp-{n}")
        prefill_ms = (t1 - t0 - (t2 - t1)) * 1e3
        mb = n * kv_bytes_per_token / 1e6
        print(f"draft prompt KV of {n:5d} tokens: computed on the decode {prefill_ms:7.1f} ms; as a transfer "
              f"{mb:6.1f} MB = {mb / 2.07:6.1f} ms at the box's 2.07 GB/s NIXL DRAM rate")


if __name__ == "__main__":
    main()
