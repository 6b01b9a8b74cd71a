"""Speculative decoding on the CPU box: per-token decode latency with and without ngram speculation, side by
side in one run, at batch 1, on the embedded model (SmolLM2-135M-Instruct).

    python benchmarks/bench_spec_decode.py --rounds 4 --max-tokens 160
    python benchmarks/bench_spec_decode.py --batch 8          # + throughput at batch 8: plain, ngram, ngram
                                                              #   with disable_by_batch_size=4
    python benchmarks/bench_spec_decode.py --draft-prefill    # + what a draft model's prompt prefill costs a
                                                              #   decode instance, against moving its KV

Both engines live in one process and take turns (A/B/A/B per workload and round), so a load change on the
shared box hits both halves of a round alike; each round's ratio is printed with the load average. The
metric is the decode time per output token (TPOT: (last token - first token) / (tokens - 1)), which is what
ITL means per token: with speculation several tokens arrive per step, so the gap between arrivals is not
comparable. Greedy outputs of the two engines are checked to be identical.
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
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 3}


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def make_engine(spec: dict | None, max_num_seqs: int = 8):
    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig

    return LLMEngine(EngineConfig(device="cpu", max_num_seqs=max_num_seqs, speculative_config=spec))


def run_one(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """Greedy; returns the tokens, TPOT in ms, and this process's CPU ms per output token after the first
    (less sensitive than wall time to the other processes on a shared box)."""
    from pdserve.types.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    out: list[int] = []
    first = last = cpu_first = None
    cpu_last = 0.0
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids:
                last, cpu_last = time.perf_counter(), time.process_time()
                if first is None:
                    first, cpu_first = last, cpu_last
                out.extend(o.new_token_ids)
    assert first is not None and cpu_first is not None and len(out) > 1
    return out, (last - first) / (len(out) - 1) * 1e3, (cpu_last - cpu_first) / (len(out) - 1) * 1e3


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
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=0, help="also measure throughput at this batch size")
    ap.add_argument("--draft-prefill", action="store_true")
    ap.add_argument("--k", type=int, default=NGRAM["num_speculative_tokens"])
    ap.add_argument("--lookup", default="3,5", help="prompt_lookup_min,prompt_lookup_max")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lookup.split(","))
    NGRAM.update(num_speculative_tokens=args.k, prompt_lookup_min=lo, prompt_lookup_max=hi)

    from transformers import AutoTokenizer

    from pdserve.model.default_model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    plain, spec = make_engine(None), make_engine(NGRAM)
    print(f"speculative_config: {NGRAM}")
    for name, text in WORKLOADS.items():
        prompt = chat_ids(tok, text)
        ratios, tp, ts, cpu_ratios = [], [], [], []
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
            print(f"  {name:16s} round {r}: load {load:5.1f}  plain {got['plain'][1]:6.1f} ms/token  "
                  f"ngram {got['ngram'][1]:6.1f} ms/token  speedup {ratios[-1]:.2f}x  (CPU ms/token "
                  f"{got['plain'][2]:.1f} vs {got['ngram'][2]:.1f}: {cpu_ratios[-1]:.2f}x; {len(got['plain'][0])} tokens)")
        acc1 = spec.stats().spec_decode
        drafted = acc1.num_draft_tokens - acc0.num_draft_tokens
        accepted = acc1.num_accepted_tokens - acc0.num_accepted_tokens
        drafts = acc1.num_drafts - acc0.num_drafts
        print(f"{name:16s}: median TPOT plain {statistics.median(tp):.1f} ms, ngram {statistics.median(ts):.1f} ms; "
              f"speedup median {statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
              f"in CPU time {statistics.median(cpu_ratios):.2f}x; "
              f"acceptance {100 * accepted / max(drafted, 1):.0f} %, {1 + accepted / max(drafts, 1):.2f} tokens "
              f"per verify step")
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
