"""Checks of the speculative verify step in CUDA graphs (issue 42), run on the GPU machine:

    python -m pdserve.testing.spec_verify_check            # prints a JSON report, exits 1 on any failure

1. The multi-query paged decode kernel (`triton_kernels.decode_attention(rows_per_seq=R)`) vs a float32 SDPA
   reference, with drafts padded to K (padded rows repeat the last real position and must not change the
   real rows), padding sequences (seq_len 0), every split count; bf16 and an fp8 pool. The CPU tests run
   the same check under Triton's interpreter (tests/test_spec_verify_graphs.py).
2. Engines on tiny float32 models (the tests' builder, no download), greedy, ngram speculation: the verify
   step replayed from its CUDA graphs == the eager verify step (PDSERVE_SPEC_VERIFY_GRAPHS=0's path) ==
   plain decoding without speculation, token for token; the graph engine must have run verify graphs.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.attention.paged_reference import SdpaReference, fp8_case, make_paged_case, rel_err

# (context before the step, real drafts) per sequence; R = K + 1 rows each; None: a padding sequence
VERIFY_KERNEL_CASES: list[dict[str, Any]] = [
    {"name": "k4-even", "seqs": [(2043, 4), (100, 4)], "k": 4, "h": 32, "kvh": 8, "d": 128},
    {"name": "k4-uneven+pad", "seqs": [(60, 4), (1, 0), (511, 2), None, (2000, 1)], "k": 4, "h": 32, "kvh": 8,
     "d": 128},
    {"name": "k3-gqa7", "seqs": [(300, 3), (17, 1)], "k": 3, "h": 28, "kvh": 4, "d": 128},
]


def verify_case(seqs: list[tuple[int, int] | None], k: int, h: int, kvh: int, d: int, dtype: torch.dtype,
                device: str, block_size: int = 16, seed: int = 0):
    """A paged case for a verify step: sequence b's real query rows are its last kb + 1 positions (ctx + kb + 1
    keys), padded to K + 1 rows that repeat the last real position; padding sequences have seq_len 0.
    Returns (case of the real rows, padded q [B * (K + 1), h, d], seq_lens [B], block tables [B, W],
    positions [B * (K + 1)], real row index of each padded row or -1)."""
    real = [s for s in seqs if s is not None]
    c = make_paged_case([kb + 1 for _, kb in real], [ctx + kb + 1 for ctx, kb in real], h, kvh, d,
                        block_size=block_size, dtype=dtype, device=device, seed=seed)
    rows = k + 1
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn((len(seqs) * rows, h, d), generator=gen, device=device).to(dtype)  # padded rows: noise
    width = c.meta.block_tables.shape[1]
    tables = torch.zeros((len(seqs), width), dtype=torch.int64, device=device)
    seq_lens = torch.zeros(len(seqs), dtype=torch.int64, device=device)
    positions = torch.zeros(len(seqs) * rows, dtype=torch.int64)
    source = [-1] * (len(seqs) * rows)
    r = 0  # the real sequence's index in c
    start = 0  # its first query row in c.q
    for b, s in enumerate(seqs):
        if s is None:
            continue
        ctx, kb = s
        tables[b] = c.meta.block_tables[r]
        seq_lens[b] = ctx + kb + 1
        for i in range(rows):
            positions[b * rows + i] = ctx + min(i, kb)
            if i <= kb:
                q[b * rows + i] = c.q[start + i]
                source[b * rows + i] = start + i
        r += 1
        start += kb + 1
    return c, q, seq_lens, tables, positions.to(device), source


def check_verify_kernel(dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                        cases: list[dict[str, Any]] | None = None, block_size: int = 16, tile_n: int = 64,
                        splits_list: tuple[int, ...] = (1, 2, 7, 16), fp8: tuple[str, ...] = ("fp8_e4m3",),
                        ) -> list[dict[str, Any]]:
    """decode_attention with rows_per_seq = K + 1 vs SDPA in float32 on the real rows; padded rows finite,
    padding sequences all zero."""
    from pdserve.attention import fp8_kv
    from pdserve.attention import triton_kernels as tk

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = SdpaReference(torch.float32)
    results: list[dict[str, Any]] = []
    for n, case in enumerate(cases or VERIFY_KERNEL_CASES):
        c, q, seq_lens, tables, positions, source = verify_case(case["seqs"], case["k"], case["h"], case["kvh"],
                                                                case["d"], dtype, device, block_size, seed=300 + n)
        scale = case["d"] ** -0.5
        real_rows = [i for i, s in enumerate(source) if s >= 0]
        src = [source[i] for i in real_rows]
        pad_seqs = [b for b, s in enumerate(case["seqs"]) if s is None]
        rows = case["k"] + 1
        for fmt_name in (None, *fp8):
            fmt = fp8_kv.fp8_format(fmt_name) if fmt_name else None
            if fmt is None:
                cc, cf = c, c
            else:
                cc, cf = fp8_case(c, fmt_name)
            want = ref.forward(cf.q, cf.k_cache, cf.v_cache, cf.meta, scale).float()
            for splits in splits_list:
                out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
                tk.decode_attention(q, cc.k_cache, cc.v_cache, tables, seq_lens, scale, splits, out=out,
                                    tile_n=tile_n, kv_format=fmt, rows_per_seq=rows, query_positions=positions)
                err = rel_err(out[real_rows], want[src])
                pads_zero = all(bool((out[b * rows : (b + 1) * rows] == 0).all()) for b in pad_seqs)
                results.append({"kernel": "verify-decode" + (f"[{fmt_name}]" if fmt_name else ""),
                                "case": case["name"], "splits": splits, "rel_err": err,
                                "ok": err < tol and bool(torch.isfinite(out).all()) and pads_zero})
    return results


def check_verify_engines(archs: tuple[str, ...] = ("llama", "qwen3"), max_tokens: int = 40,
                         device: str = "cuda") -> list[dict[str, Any]]:
    """Greedy tokens: verify graphs == eager verify == no speculation, on repetitive prompts (drafts accepted,
    uneven draft lengths in one batch) and random ones (few drafts), several requests at once."""
    import os

    from pdserve.engine.engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig
    from pdserve.types.sampling_params import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny_models import make_tiny_model  # the tests' builder: save_pretrained, no download

    results: list[dict[str, Any]] = []
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    for arch in archs:
        t0 = time.perf_counter()
        model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch)
        gen = torch.Generator().manual_seed(5)
        prompts = [[5, 6, 7, 8, 9, 10, 11] * 6, list(range(20, 60)) * 2, [3, 4] * 20, [319, 17, 90] * 9]
        prompts += [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (9, 40, 130)]
        common = dict(model=str(model_dir), dtype="float32", max_num_batched_tokens=256, num_gpu_blocks_override=256,
                      max_num_seqs=8, max_model_len=1024, device=device)
        outs: dict[str, list[list[int]]] = {}
        info: dict[str, Any] = {}
        for name, spec, graphs in (("plain", None, True), ("graph", ngram, True), ("eager", ngram, False)):
            old = os.environ.get("PDSERVE_SPEC_VERIFY_GRAPHS")
            os.environ["PDSERVE_SPEC_VERIFY_GRAPHS"] = "1" if graphs else "0"
            try:
                eng = LLMEngine(EngineConfig(speculative_config=spec, **common))
                if device == "cpu":  # a dry run of this check: the GPU step path with its graphs simulated
                    from pdserve.attention.torch_ref import TorchAttention

                    eng.runner.backend = TorchAttention()
                    eng.runner.model.fused_ops = None
                    eng.runner.use_gpu_step_runner(simulate_graphs=True)
            finally:
                if old is None:
                    del os.environ["PDSERVE_SPEC_VERIFY_GRAPHS"]
                else:
                    os.environ["PDSERVE_SPEC_VERIFY_GRAPHS"] = old
            outs[name] = _run(eng, prompts, greedy)
            if spec is not None:
                s = eng.stats().spec_decode
                info[name] = {"accepted": s.num_accepted_tokens, "drafted": s.num_draft_tokens,
                              "verify_graph_steps": eng.runner.gpu.verify_graph_steps,
                              "verify_graphs": sorted(eng.runner.gpu.verify_graphs)}
            del eng
            if device == "cuda":
                torch.cuda.empty_cache()
        n = len(prompts)
        eq = {f"{a}_eq_{b}": sum(x == y for x, y in zip(outs[a], outs[b], strict=True))
              for a, b in (("graph", "eager"), ("graph", "plain"), ("eager", "plain"))}
        results.append({
            "arch": arch, "prompts": n, **eq, **info,
            "ok": all(v == n for v in eq.values()) and info["graph"]["verify_graph_steps"] > 0
            and info["eager"]["verify_graph_steps"] == 0 and info["graph"]["accepted"] > 0
            and info["graph"]["accepted"] == info["eager"]["accepted"],
            "seconds": round(time.perf_counter() - t0, 1),
        })
    return results


def _run(engine, prompts: list[list[int]], params) -> list[list[int]]:
    ids = [f"v{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(10_000):
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        if not engine.has_unfinished():
            return [got[rid] for rid in ids]
    raise RuntimeError("the engine did not finish")


def check_skinny_gemm(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """The experimental few-row linear kernel (engine/runner/skinny_gemm.py, off by default) vs a float32
    matmul, at the 8B model's shapes: what `gpu_spec_verify_cost.py --skinny-ab` times must be right."""
    from pdserve.engine.runner.skinny_gemm import skinny_matmul

    gen = torch.Generator(device=device).manual_seed(3)
    results: list[dict[str, Any]] = []
    for m, n, k in ((5, 6144, 4096), (20, 4096, 4096), (5, 28672, 4096), (32, 4096, 14336), (5, 128256, 4096)):
        x = torch.randn((m, k), generator=gen, device=device).to(dtype)
        w = (torch.randn((n, k), generator=gen, device=device) * k**-0.5).to(dtype)
        want = x.float() @ w.float().t()
        err = rel_err(skinny_matmul(x, w), want)
        results.append({"kernel": "skinny_gemm", "shape": [m, n, k], "rel_err": err, "ok": err < 1e-2})
    return results


def main() -> int:
    report: dict[str, Any] = {"verify_kernel": check_verify_kernel(), "verify_engines": check_verify_engines()}
    try:  # an experiment (off by default): reported, not part of the exit status
        report["skinny_gemm_experiment"] = check_skinny_gemm()
    except Exception as e:  # noqa: BLE001
        report["skinny_gemm_experiment"] = [{"error": f"{type(e).__name__}: {e}", "ok": False}]
    print(json.dumps(report, indent=1))
    return 0 if all(r["ok"] for k in ("verify_kernel", "verify_engines") for r in report[k]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
