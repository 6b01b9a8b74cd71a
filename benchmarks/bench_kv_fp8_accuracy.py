"""FP8 KV cache accuracy on the real embedded model (SmolLM2-135M-Instruct), on CPU.

Runs a fixed set of chat prompts to N greedy tokens (ignore_eos) with the KV cache in the model's dtype
(float32 on CPU: the reference) and with each fp8 format, then reports per format:

- token agreement: share of the N positions where the fp8 run chose the reference's token;
- common prefix: share of the N tokens before the first divergence (after it the contexts differ);
- logprob |diff|: mean absolute difference of the chosen token's logprob, over the common prefix
  (same context, same token, so the difference is the KV quantization's alone);
- prompts fully identical.

    python benchmarks/bench_kv_fp8_accuracy.py --num-prompts 50 --max-tokens 64 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

TOPICS = (
    "the water cycle", "photosynthesis", "the French Revolution", "black holes", "how vaccines work",
    "the stock market", "machine learning", "the Roman Empire", "climate change", "the human heart",
    "volcanoes", "the internet", "democracy", "the moon landing", "plate tectonics", "honey bees",
    "the printing press", "electric cars", "the Great Wall of China", "DNA", "rainbows", "the Olympic Games",
    "coffee", "the theory of relativity", "recycling",
)
TEMPLATES = ("Explain {} in simple terms.", "Write three short facts about {}.")


def prompts(n: int) -> list[str]:
    """The fixed prompt set: topic x template, in a stable order (n <= 50)."""
    out = [t.format(topic) for t in TEMPLATES for topic in TOPICS]
    if n > len(out):
        raise ValueError(f"at most {len(out)} prompts")
    return out[:n]


@dataclass
class Agreement:
    kv_cache_dtype: str
    prompts: int
    tokens_per_prompt: int
    token_agreement: float
    common_prefix: float
    logprob_mad: float
    identical_prompts: int


def run(kv_cache_dtype: str, texts: list[str], max_tokens: int) -> list[list[tuple[int, float]]]:
    """[(token, logprob)] per prompt, greedy."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.llm import LLM

    llm = LLM(kv_cache_dtype=kv_cache_dtype, device="cpu", cpu_kv_cache_gb=0.25, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    results = llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)
    return [[(lp.token_id, lp.logprob) for lp in r.outputs[0].logprobs] for r in results]


def compare(name: str, ref: list[list[tuple[int, float]]], got: list[list[tuple[int, float]]]) -> Agreement:
    same = total = prefix = identical = 0
    diffs: list[float] = []
    for r, g in zip(ref, got, strict=True):
        n = len(r)
        total += n
        same += sum(a[0] == b[0] for a, b in zip(r, g, strict=True))
        k = 0
        while k < n and r[k][0] == g[k][0]:
            diffs.append(abs(r[k][1] - g[k][1]))
            k += 1
        prefix += k
        identical += k == n
    return Agreement(name, len(ref), len(ref[0]), same / total, prefix / total,
                     sum(diffs) / max(len(diffs), 1), identical)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--formats", default="fp8_e4m3,fp8_e5m2")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    texts = prompts(args.num_prompts)
    t0 = time.time()
    ref = run("auto", texts, args.max_tokens)
    rows = []
    for fmt in args.formats.split(","):
        rows.append(compare(fmt, ref, run(fmt, texts, args.max_tokens)))
    print(f"{len(texts)} prompts x {args.max_tokens} greedy tokens, reference: float32 KV "
          f"({time.time() - t0:.0f} s)")
    print(f"{'kv cache':10} {'token agreement':>16} {'common prefix':>14} {'logprob |diff|':>15} {'identical':>10}")
    for a in rows:
        print(f"{a.kv_cache_dtype:10} {a.token_agreement:16.4f} {a.common_prefix:14.4f} {a.logprob_mad:15.5f} "
              f"{a.identical_prompts:>5}/{a.prompts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(a) for a in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
