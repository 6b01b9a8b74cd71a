"""The engine paths that have only run on CPU so far, on a GPU against the CPU engine (float32, tiny models):

- speculative decoding (ngram): greedy tokens with speculation equal those without it, on the GPU and the CPU,
  with its acceptance counts (the verify step runs eagerly; draft-free steps replay graphs);
- prompt logprobs (prompt_logprobs): the GPU's values against the CPU engine's (the rows that predict prompt
  tokens go through the GPU step runner's eager path).

Prints one JSON report and exits non-zero on a mismatch. Usage (from the repository root, on a CUDA machine):
    python benchmarks/gpu_new_paths.py [--device cuda] [--archs llama,qwen3]
On a CPU box `--device cpu` runs the same comparison CPU against CPU (a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.testing.gpu_correctness import _run_engine  # noqa: E402
from pdserve.types.engine_config import EngineConfig  # noqa: E402
from pdserve.types.sampling_params import SamplingParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPT_LOGPROB_TOL = 1e-4  # float32 on both devices


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 320, (12,), generator=gen).tolist()
    # repetitive prompts give the ngram proposer drafts to verify; random ones give it none
    return [motif * 6, (motif[:7] + [9, 9]) * 8, torch.randint(3, 320, (40,), generator=gen).tolist(),
            torch.randint(3, 320, (150,), generator=gen).tolist()]


def _engine(model_dir: Path, device: str, **extra: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="float32", max_num_batched_tokens=64,
                                  num_gpu_blocks_override=256, max_num_seqs=8, max_model_len=1024, **extra))


def _spec_counts(engine: LLMEngine) -> dict[str, Any]:
    """The engine's own speculative-decoding counters (the ones /metrics exports), whatever their form."""
    stats = engine.stats()
    return {k: v for k, v in vars(stats).items() if "spec" in k or "draft" in k or "accepted" in k}


def check_spec_decode(model_dir: Path, device: str, max_tokens: int = 32) -> dict[str, Any]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = _prompts(5)
    outs: dict[str, list[list[int]]] = {}
    counts: dict[str, Any] = {}
    for name, dev, spec in (("cpu_plain", "cpu", None), ("plain", device, None), ("ngram", device, NGRAM),
                            ("cpu_ngram", "cpu", NGRAM)):
        eng = _engine(model_dir, dev, speculative_config=spec)
        outs[name] = _run_engine(eng, prompts, greedy)
        if spec is not None:
            counts[name] = _spec_counts(eng)
        del eng
    mismatches = [name for name in outs if outs[name] != outs["cpu_plain"]]
    return {"ok": not mismatches, "mismatches": mismatches, "spec_counts": counts}


def check_prompt_logprobs(model_dir: Path, device: str) -> dict[str, Any]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    prompts = _prompts(7)
    values: dict[str, list[list[float]]] = {}
    for name, dev in (("cpu", "cpu"), (device, device)):
        eng = _engine(model_dir, dev)
        base = eng.num_finished
        ids = [f"p{base}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            eng.add_request(rid, p, params)
        got: dict[str, list[float]] = {}
        for _ in range(10_000):  # bounded: a handful of steps at these sizes
            if not eng.has_unfinished():
                break
            for o in eng.step():
                if o.prompt_logprobs is not None:
                    got[o.request_id] = [lp.logprob for lp in o.prompt_logprobs[1:]]
        values[name] = [got[rid] for rid in ids]
        del eng
    worst = max(abs(a - b) for ra, rb in zip(values["cpu"], values[device], strict=True)
                for a, b in zip(ra, rb, strict=True))
    lengths_ok = all(len(v) == len(p) - 1 for v, p in zip(values[device], prompts, strict=True))
    return {"ok": lengths_ok and worst <= PROMPT_LOGPROB_TOL, "worst_abs_diff": worst, "tolerance": PROMPT_LOGPROB_TOL}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--archs", default="llama,qwen3")
    args = ap.parse_args()
    from tiny_models import make_tiny_model  # the tests' builder: save_pretrained, no download

    report: dict[str, Any] = {"device": args.device}
    for arch in args.archs.split(","):
        t0 = time.perf_counter()
        model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch)
        report[arch] = {"spec_decode": check_spec_decode(model_dir, args.device),
                        "prompt_logprobs": check_prompt_logprobs(model_dir, args.device),
                        "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report, indent=1, default=str))
    ok = all(r[k]["ok"] for a, r in report.items() if a != "device" for k in ("spec_decode", "prompt_logprobs"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
