"""Writes the shipped H200 profiles (Llama-3.1-8B shape, bf16 and fp8 KV, TP=1) from numbers BENCHMARKS.md
already has, measured on `nvidia-h200` machines; no number here is new or guessed, each says where it is from.

    python benchmarks/sim_h200_profiles.py --out-dir pdserve/data/profiles

Measured points (BENCHMARKS.md section, run):
- prefill, one prompt alone, chunks of 8192 (the engine's budget then): 8192 tokens 215.1 ms ("Issue 36: the 8k
  prefill's host time", run 3 wall); 32768 tokens 1267 ms, 65536 tokens 3515 ms, 131000 tokens 10813 ms
  ("Long-context prefill: TTFT of one prompt", `triton-cudnn` run 4);
- decode steps (async scheduling on): batch 1, 128-token prompt: 4.18 ms ("Third pass: async scheduling", run 8
  P1); batch 64 at 2k context each: 8.86 ms (run 8 P2); batch 64 at 4k context: bf16 12.80 ms, fp8 9.25 ms
  ("Run 7: the CUDA fp8 decode kernel", run 3);
- KV pool at gpu_memory_utilization 0.9: bf16 47466 blocks, fp8 93566 blocks of 16 tokens ("The aligned fp8
  layout" table); KV bytes per token: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes (bf16) = 131072, fp8 one
  byte plus the 2 scale bytes per 128 values = 67584 (the same table: 1.97x the blocks);
- weights: 15.0 GB read per decode step ("Decode, batch 1 (P1)": "the 15.0 GB of weights");
- handoff (1P1D on one H200, "1P1D handoff, second pass", run B medians): the prefill's params back 2.06 ms +
  params posted to load start 1.64 ms = 3.70 ms; load start to the lease claim (first token) 1.59 ms; the 1 GiB
  READ of an 8192-token prompt 2.98 ms after the token (so the link: 1 GiB / 2.98 ms);
- HTTP: client send to engine arrival 6.10 ms, first token to the client 1.67 ms (collocated, same table).

fp8's prefill is taken as bf16's (the fp8 KV cache changes the decode kernel and the K/V store; no fp8 prefill
time was measured); fp8's decode points other than b64/4k are not measured, so its fit uses bf16's b1 and
b64/2k points with the context term from the fp8 b64/4k step (marked in the profile's notes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.sim.profile import EngineSettings, Handoff, Overheads, Profile, refit

GIB = 1 << 30
H200_MEMORY = 143771 * (1 << 20)  # nvidia-smi's 143771 MiB (reference/h200-facts.md)


def h200_8b(kv: str) -> Profile:
    fp8 = kv == "fp8"
    prof = Profile(
        name=f"h200-llama3.1-8b-{kv}", model="Llama-3.1-8B", device="cuda", tp=1,
        kv_cache_dtype="fp8_e4m3" if fp8 else "auto",
        kv_capacity_tokens=(93566 if fp8 else 47466) * 16,
        kv_bytes_per_token=67584 if fp8 else 131072,
        gpu_memory_bytes=H200_MEMORY, weights_bytes=int(15.0e9),
        engine=EngineSettings(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                              prefill_only_chunk_tokens=32768, enable_chunked_prefill=True,
                              enable_prefix_caching=True),
        prefill_points=[
            {"new": 8192, "cached": 0, "chunk": 8192, "seconds": 0.2151},
            {"new": 32768, "cached": 0, "chunk": 8192, "seconds": 1.267},
            {"new": 65536, "cached": 0, "chunk": 8192, "seconds": 3.515},
            {"new": 131000, "cached": 0, "chunk": 8192, "seconds": 10.813},
        ],
        decode_points=[
            {"batch": 1, "context": 129, "seconds": 0.00418},
            {"batch": 64, "context": 64 * 2048, "seconds": 0.00886},
            {"batch": 64, "context": 64 * 4096, "seconds": 0.00925 if fp8 else 0.01280},
        ],
        handoff=Handoff(params_s=0.00370, claim_s=0.00159, link_bytes_per_s=GIB / 0.00298,
                        points=[{"bytes": 8192 * 131072, "seconds": 0.00298}]),
        overheads=Overheads(ingress_s=0.00610, egress_s=0.00167),
        source="fitted by benchmarks/sim_h200_profiles.py from BENCHMARKS.md's H200 measurements (its docstring "
               "names each number's section and run)",
        notes=["TP=1, one H200, Llama-3.1-8B shape, dummy weights; the link rate is intra-host (P and D on one "
               "GPU): a fleet across hosts has the NIC's rate instead (edit handoff.link_bytes_per_s)"],
    )
    refit(prof)
    if fp8:
        # Only the b64/4k step was measured with fp8 KV: bf16's fit for the rest, the KV-read term (decode
        # context) refitted to that one step.
        bf16 = h200_8b("bf16")
        m = dict(bf16.step_model)
        without_ctx = m["fixed"] + 64 * (m["tokens"] + m["decode_rows"])
        m["decode_context"] = (0.00925 - without_ctx) / (64 * 4096)
        prof.step_model = m
        prof.decode_points = [{"batch": 64, "context": 64 * 4096, "seconds": 0.00925}]
        prof.fit_residuals = {"note": "bf16's fit, decode_context refitted to the fp8 b64/4k step (exact there)"}
        prof.notes.append("fp8: prefill and the fixed/token costs are bf16's (not measured with fp8 KV); the "
                          "b64/4k decode step (9.25 ms) and the pool size are the fp8 measurements")
    return prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="pdserve/data/profiles")
    args = ap.parse_args()
    for kv in ("bf16", "fp8"):
        prof = h200_8b(kv)
        path = Path(args.out_dir) / f"{prof.name}.json"
        prof.save(path)
        print(f"{path}: step model {prof.step_model}, fit {prof.fit_residuals}")


if __name__ == "__main__":
    main()
