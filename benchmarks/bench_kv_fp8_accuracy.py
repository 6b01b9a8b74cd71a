"""FP8 KV cache accuracy on the real embedded model (SmolLM2-135M-Instruct), on CPU or a GPU.

Runs a fixed set of chat prompts to N greedy tokens (ignore_eos) with the KV cache in the model's dtype
(the reference: float32 KV on CPU by default, bfloat16 with `--dtype bfloat16`, the GPU's default) and with
each fp8 format, then reports per format:

- token agreement: share of the N positions where the fp8 run chose the reference's token;
- common prefix: share of the N tokens before the first divergence (after it the contexts differ);
- logprob |diff|: mean absolute difference of the chosen token's logprob, over the common prefix
  (same context, same token, so the difference is the KV quantization's alone);
- prompts fully identical;
- the greedy chat answer to "What is the capital of France?" (it must still say Paris).

With `--checkpoint-kv-scales` each fp8 format also runs with static per-tensor k_scale/v_scale, as a
quantized checkpoint carries them (rows `<format>+ckpt`): per layer, the K and V amax of a reference run
over separate calibration prompts / 448 (the fp8_e4m3 max), written under compressed-tensors' names into a
copy of the model folder (symlinks plus one extra safetensors file), which the real loader then reads.

    python benchmarks/bench_kv_fp8_accuracy.py --num-prompts 50 --max-tokens 64 [--json out.json]
    python benchmarks/bench_kv_fp8_accuracy.py --device cpu --dtype bfloat16      # bf16 KV as the reference
    python benchmarks/bench_kv_fp8_accuracy.py --device cuda                       # H200: bf16 model and KV
    python benchmarks/bench_kv_fp8_accuracy.py --formats fp8_e4m3 --checkpoint-kv-scales   # static scales too
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
    capital_answer: str = ""
    first_divergence: list[int] | None = None  # per prompt: tokens before the first differing one


CAPITAL_QUESTION = "What is the capital of France?"
CALIBRATION_TEMPLATE = "Tell me a short story about {}."  # not one of TEMPLATES: calibrate off the test set


def pool_blocks(device: str) -> int:
    """Blocks of the device's default size for 32k tokens: every prompt's KV at once."""
    from pdserve.types.engine_config import default_block_size

    return 32768 // default_block_size(device)


def run(kv_cache_dtype: str, texts: list[str], max_tokens: int, device: str = "cpu",
        dtype: str = "auto", model: str | None = None) -> tuple[list[list[tuple[int, float]]], str]:
    """[(token, logprob)] per prompt, greedy; and the greedy answer to CAPITAL_QUESTION."""
    from pdserve.llm import LLM
    from pdserve.types.sampling_params import SamplingParams

    # a small pool: 50 prompts x ~100 tokens need ~400 blocks of 16
    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, device=device, dtype=dtype,
              num_gpu_blocks_override=pool_blocks(device), enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        results = llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)
        answer = llm.chat([[{"role": "user", "content": CAPITAL_QUESTION}]],
                          SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    finally:
        llm.engine.shutdown()
    return [[(lp.token_id, lp.logprob) for lp in r.outputs[0].logprobs] for r in results], answer


def calibrate_kv_scales(max_tokens: int, device: str = "cpu", dtype: str = "auto",
                        model: str | None = None) -> list[tuple[float, float]]:
    """Per layer (k_scale, v_scale) = amax / 448 of the K and V a reference run (KV in the model's dtype)
    stores for the calibration prompts: what a max-calibrating quantization tool writes."""
    from pdserve.llm import LLM
    from pdserve.types.sampling_params import SamplingParams

    llm = LLM(model, device=device, dtype=dtype, num_gpu_blocks_override=pool_blocks(device),
              enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.chat([[{"role": "user", "content": CALIBRATION_TEMPLATE.format(t)}] for t in TOPICS], params,
                 use_tqdm=False)
        pool = llm.engine.runner.kv_pool  # [blocks, layers, K|V, ...]; unused slots are zero
        amax = pool.abs().amax(dim=(0, 3, 4, 5)).float().cpu()
        return [(float(amax[i, 0]) / 448.0, float(amax[i, 1]) / 448.0) for i in range(amax.shape[0])]
    finally:
        llm.engine.shutdown()


def with_kv_scales(model: str | None, scales: list[tuple[float, float]], out_dir: Path) -> Path:
    """A copy of the model folder (its files symlinked) plus `kv_scales.safetensors` holding
    model.layers.N.self_attn.k_scale / v_scale (compressed-tensors' names)."""
    import torch
    from safetensors.torch import save_file

    from pdserve.model.default_model import resolve_model

    src = Path(resolve_model(model))
    out_dir.mkdir(parents=True)
    for f in src.iterdir():
        (out_dir / f.name).symlink_to(f.resolve())
    tensors = {}
    for i, (k, v) in enumerate(scales):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(tensors, str(out_dir / "kv_scales.safetensors"), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint lists its files: add ours
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, "kv_scales.safetensors"))
        (out_dir / index.name).unlink()
        (out_dir / index.name).write_text(json.dumps(data))
    return out_dir


def compare(name: str, ref: list[list[tuple[int, float]]], got: list[list[tuple[int, float]]],
            answer: str = "") -> Agreement:
    same = total = prefix = identical = 0
    diffs: list[float] = []
    firsts: list[int] = []
    for r, g in zip(ref, got, strict=True):
        n = len(r)
        total += n
        same += sum(a[0] == b[0] for a, b in zip(r, g, strict=True))
        k = 0
        while k < n and r[k][0] == g[k][0]:
            diffs.append(abs(r[k][1] - g[k][1]))
            k += 1
        prefix += k
        firsts.append(k)
        identical += k == n
    return Agreement(name, len(ref), len(ref[0]), same / total, prefix / total,
                     sum(diffs) / max(len(diffs), 1), identical, answer, firsts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--formats", default="fp8_e4m3,fp8_e5m2")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on CUDA); "
                                                     "the reference KV cache stores this dtype")
    ap.add_argument("--model", default=None, help="a local HF model folder (default: the embedded SmolLM2)")
    ap.add_argument("--checkpoint-kv-scales", action="store_true",
                    help="also run each format with calibrated per-tensor k_scale/v_scale in the checkpoint")
    args = ap.parse_args(argv)
    rows = measure(prompts(args.num_prompts), args.max_tokens, args.formats.split(","), args.device, args.dtype,
                   args.model, args.checkpoint_kv_scales)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(a) for a in rows], f, indent=1)
    return 0


def measure(texts: list[str], max_tokens: int, formats: list[str], device: str = "cpu",
            dtype: str = "auto", model: str | None = None, checkpoint_kv_scales: bool = False) -> list[Agreement]:
    """The reference run (KV in the model's dtype) first, then each fp8 format against it (and with
    calibrated checkpoint scales, when asked)."""
    t0 = time.time()
    ref, ref_answer = run("auto", texts, max_tokens, device, dtype, model)
    rows = [compare("auto", ref, ref, ref_answer)]
    for fmt in formats:
        got, answer = run(fmt, texts, max_tokens, device, dtype, model)
        rows.append(compare(fmt, ref, got, answer))
    if checkpoint_kv_scales:
        scales = calibrate_kv_scales(max_tokens, device, dtype, model)
        print("calibrated (k_scale, v_scale) per layer:", [(round(k, 5), round(v, 5)) for k, v in scales])
        with tempfile.TemporaryDirectory() as tmp:
            scaled = str(with_kv_scales(model, scales, Path(tmp) / "model"))
            for fmt in formats:
                got, answer = run(fmt, texts, max_tokens, device, dtype, scaled)
                rows.append(compare(f"{fmt}+ckpt", ref, got, answer))
    print(f"{len(texts)} prompts x {max_tokens} greedy tokens on {device} (model dtype {dtype}), reference: "
          f"KV in the model's dtype ({time.time() - t0:.0f} s)")
    return rows


def print_rows(rows: list[Agreement]) -> None:
    print(f"{'kv cache':14} {'token agreement':>16} {'common prefix':>14} {'logprob |diff|':>15} {'identical':>10}"
          "  capital answer")
    for a in rows:
        print(f"{a.kv_cache_dtype:14} {a.token_agreement:16.4f} {a.common_prefix:14.4f} {a.logprob_mad:15.5f} "
              f"{a.identical_prompts:>5}/{a.prompts}  {a.capital_answer!r}")


if __name__ == "__main__":
    sys.exit(main())
