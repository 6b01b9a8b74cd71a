"""Shared-prefix reuse on one instance (CPU box or GPU): the same `pdserve bench --dataset-name shared-prefix` workload
against `pdserve serve` with prefix caching off, with prefix caching in a KV pool too small for the
documents, and with that pool plus the host-memory tier (`--kv-offloading-size`). Writes each run's
result JSON and a summary (computed prompt tokens, TTFT p50/p99) under --out.

    python benchmarks/kv_reuse.py --out benchmarks/results/kv-reuse-cpu
    # a GPU: the 8B shape with dummy weights (no tokenizer of its own: the client's and the server's given)
    python benchmarks/kv_reuse.py --model Llama-3.1-8B --load-format dummy --tokenizer TOKENIZER_DIR \
        --prefix-len 4096 --pool-blocks 384 --offload-gib 4 --out gpu-out/kv-reuse
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

CONFIGS = {
    "no-reuse": ["--no-enable-prefix-caching"],
    "pool-only": [],
    "pool+host-tier": ["--kv-offloading-size", "{offload_gib}", "--kv-offloading-backend", "native"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=18)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--pool-blocks", type=int, default=96, help="KV pool size: less than the documents need")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--model", default=None, help="model folder or packaged shape (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokenizer", default=None, help="for client and server (default: the embedded SmolLM2's)")
    ap.add_argument("--offload-gib", type=float, default=0.5, help="host tier size of the pool+host-tier run")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from pdserve.model.default_model import resolve_model

    tokenizer = args.tokenizer or str(resolve_model("smollm2-135m"))
    model = [args.model, "--load-format", args.load_format, "--tokenizer", tokenizer] if args.model else []
    summary = {}
    for name in args.configs.split(","):
        port = free_port()
        log = open(out / f"{name}.server.log", "wb")  # noqa: SIM115 - closed below
        server = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", *model, "--host", "127.0.0.1", "--port", str(port),
             "--num-gpu-blocks-override", str(args.pool_blocks), "--max-model-len", str(args.max_model_len),
             "--disable-uvicorn-access-log", *(a.format(offload_gib=args.offload_gib) for a in CONFIGS[name])],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise RuntimeError(f"{name}: server exited")
                time.sleep(0.5)
            subprocess.run(
                [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                 "--tokenizer", tokenizer, "--dataset-name", "shared-prefix", "--num-prompts", str(args.num_prompts),
                 "--prefix-len", str(args.prefix_len), "--suffix-len", str(args.suffix_len),
                 "--num-prefixes", str(args.num_prefixes), "--output-len", str(args.output_len), "--ignore-eos",
                 "--max-concurrency", "1", "--temperature", "0", "--percentile-metrics", "ttft,e2el",
                 "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out),
                 "--result-filename", f"{name}.json", "--label", name, "--disable-tqdm"],
                check=True, timeout=3600)
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        finally:
            server.terminate()
            server.wait(60)
            log.close()
        r = json.loads((out / f"{name}.json").read_text())
        cached = r.get("total_cached_input_tokens") or 0
        summary[name] = {
            "requests": r["completed"], "prompt_tokens": r["total_input_tokens"], "cached_tokens": cached,
            "computed_prompt_tokens": r["total_input_tokens"] - cached,
            "ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
            "kv_tier_hits_cpu": next((float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                      if line.startswith("pdserve:kv_tier_hits_total") and 'medium="CPU"' in line),
                                     None),
            "loadavg": os.getloadavg()[0],
        }
        print(name, json.dumps(summary[name]), flush=True)
    uncached = args.num_prompts * args.suffix_len + args.num_prefixes * args.prefix_len
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "uncached_prompt_tokens": uncached,
                                                  "runs": summary}, indent=1))


if __name__ == "__main__":
    main()
