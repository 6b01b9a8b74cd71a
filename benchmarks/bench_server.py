"""What the HTTP server costs: output tokens/s through `pdserve serve` vs the offline engine, one run.

Both sides get the same prompts (random token ids, fixed seed), the same output length (ignore_eos,
greedy) and the same batch bound (`--max-num-seqs` = the client concurrency):

1. offline: `pdserve.llm.LLM(...).generate(all prompts)` in this process -> tokens/s;
2. server: `pdserve serve` as a subprocess on 127.0.0.1; `--concurrency` streaming clients (aiohttp) send
   the prompts to /v1/completions -> tokens/s (from usage), TTFT and ITL percentiles as `vllm bench serve`
   defines them (TTFT = send -> first chunk with a token, ITL = gaps between token-bearing chunks).

The two are measured in alternating rounds (the offline engine stays loaded and idles while the server is
measured, and the reverse), and the ratio server/offline is reported per round: on a shared machine the
load moves, and a round's two halves see nearly the same load. The ratio is what the HTTP layer costs;
the client runs on the same machine, so on a small box its CPU time is part of that cost. Prefix caching
is off on both sides so that repeated rounds do not turn into cache hits.

    python benchmarks/bench_server.py                       # SmolLM2-135M (embedded default), ~5 min on 2 CPUs
    python benchmarks/bench_server.py --model TINY_DIR --num-prompts 64 --concurrency 32 --output-len 64
        # a 2-layer random model: the engine is ~50x faster, so the per-token HTTP cost shows
    python benchmarks/bench_server.py --num-prompts 256 --concurrency 64 --output-len 128 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_procs import stop, wait_healthy


@dataclass
class ClientResult:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    import numpy as np

    return float(np.percentile(values, q))


def make_prompts(model_dir: Path, n: int, length: int, seed: int) -> list[list[int]]:
    from pdserve.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    allowed = [i for i in range(tok.vocab_size) if i not in tok.special_token_ids]
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(n)]


def num_blocks(args: argparse.Namespace) -> int:
    """A KV pool (of the device's default block size) that fits every concurrent sequence (no preemption on
    either side), plus slack."""
    from pdserve.types.engine_config import default_block_size

    bs = default_block_size(args.device)
    per_seq = -(-(args.input_len + args.output_len) // bs) + 1
    return args.concurrency * per_seq + 1024 // bs


class Offline:
    """The engine in this process, kept loaded across rounds (idle while the server is measured)."""

    def __init__(self, args: argparse.Namespace, prompts: list[list[int]]):
        from pdserve.llm import LLM
        from pdserve.types.sampling_params import SamplingParams

        self.llm = LLM(args.model, max_num_seqs=args.concurrency, device=args.device, dtype=args.dtype,
                       max_model_len=args.max_model_len, num_gpu_blocks_override=num_blocks(args),
                       enable_prefix_caching=False)
        self.prompts = prompts
        self.params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        self.llm.generate(prompts[: min(args.concurrency, len(prompts))], self.params)  # warm-up

    def measure(self) -> tuple[float, float]:
        """(output tokens/s, CPU seconds per 1000 output tokens)."""
        t0, c0 = time.perf_counter(), time.process_time()
        results = self.llm.generate(self.prompts, self.params)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        return tokens / elapsed, cpu / tokens * 1000


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(session: Any, url: str, model: str, prompt: list[int], output_len: int) -> ClientResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = ClientResult(ok=False)
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {await resp.text()}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage") and not chunk.get("choices"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.ok = res.output_tokens == output_len
        if not res.ok:
            res.error = f"got {res.output_tokens} tokens"
    except Exception as e:  # noqa: BLE001 - reported in the summary
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_clients(url: str, model: str, prompts: list[list[int]], args: argparse.Namespace
                      ) -> tuple[list[ClientResult], float]:
    import aiohttp

    sem = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def bounded(p: list[int]) -> ClientResult:
            async with sem:
                return await one_request(session, url, model, p, args.output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        return results, time.perf_counter() - t0


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", "--max-num-seqs", str(args.concurrency), "--device", args.device,
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning",
           "--num-gpu-blocks-override", str(num_blocks(args)), "--no-enable-prefix-caching"]
    if args.disable_access_log:
        cmd.append("--disable-uvicorn-access-log")
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the process lifetime
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="alternating offline/server measurements")
    p.add_argument("--disable-access-log", action="store_true", help="pass --disable-uvicorn-access-log")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()

    from pdserve.model.default_model import resolve_model

    model_dir = Path(args.model) if Path(args.model).is_dir() else Path(resolve_model(args.model))
    prompts = make_prompts(model_dir, args.num_prompts, args.input_len, args.seed)
    print(f"model {args.model}: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out, "
          f"concurrency {args.concurrency}", flush=True)

    offline = Offline(args, prompts)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_server_{port}.log"
    proc = start_server(args, port, log_path)
    offline_tps: list[float] = []
    offline_cpu: list[float] = []
    server_cpu: list[float] = []
    client_cpu: list[float] = []
    rounds: list[tuple[list[ClientResult], float]] = []
    try:
        wait_healthy(proc, url, 600)
        asyncio.run(run_clients(url, "bench", prompts[: args.concurrency], args))  # warm-up
        # Alternate offline and server rounds so that a change in machine load hits both alike.
        for r in range(args.rounds):
            tps, cpu = offline.measure()
            offline_tps.append(tps)
            offline_cpu.append(cpu)
            s0, c0 = process_cpu_s(proc.pid), time.process_time()
            rounds.append(asyncio.run(run_clients(url, "bench", prompts, args)))
            res, el = rounds[-1]
            tokens = sum(x.output_tokens for x in res if x.ok)
            server_cpu.append((process_cpu_s(proc.pid) - s0) / tokens * 1000)
            client_cpu.append((time.process_time() - c0) / tokens * 1000)
            print(f"round {r + 1}: offline {tps:.1f} tok/s ({cpu:.2f} CPU-s/1k tok), server {tokens / el:.1f} tok/s "
                  f"(server {server_cpu[-1]:.2f}, client {client_cpu[-1]:.2f} CPU-s/1k tok)", flush=True)
    finally:
        stop(proc)
    results = [x for res, _ in rounds for x in res]
    ok = [x for x in results if x.ok]
    failed = [x for x in results if not x.ok]
    server_tps = [sum(x.output_tokens for x in res if x.ok) / el for res, el in rounds]
    ratios = [s / o for s, o in zip(server_tps, offline_tps, strict=True)]
    ttfts = [x.ttft * 1e3 for x in ok if x.ttft is not None]
    itls = [v * 1e3 for x in ok for v in x.itls]
    summary = {
        "model": args.model, "num_prompts": args.num_prompts, "concurrency": args.concurrency,
        "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
        "successful": len(ok), "failed": len(failed),
        "server_output_tok_s": server_tps, "offline_output_tok_s": offline_tps,
        "ratio_server_over_offline": ratios, "median_ratio": statistics.median(ratios),
        "cpu_s_per_1k_tokens": {"offline": offline_cpu, "server_process": server_cpu, "client": client_cpu},
        "ttft_ms": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
        "itl_ms": {"p50": percentile(itls, 50), "p99": percentile(itls, 99)},
    }
    print(f"server:  median {statistics.median(server_tps):.1f} output tokens/s over HTTP "
          f"({len(ok)} ok, {len(failed)} failed)")
    print(f"offline: median {statistics.median(offline_tps):.1f} output tokens/s")
    print(f"ratio server/offline per round: {', '.join(f'{x:.3f}' for x in ratios)} "
          f"(median {summary['median_ratio']:.3f})")
    print(f"CPU-s per 1k output tokens (median): offline engine {statistics.median(offline_cpu):.2f}, "
          f"server process {statistics.median(server_cpu):.2f}, benchmark client {statistics.median(client_cpu):.2f}")
    print(f"TTFT ms p50 {summary['ttft_ms']['p50']:.1f}  p99 {summary['ttft_ms']['p99']:.1f}")
    print(f"ITL  ms p50 {summary['itl_ms']['p50']:.1f}  p99 {summary['itl_ms']['p99']:.1f}")
    if failed:
        print("first errors:", [x.error for x in failed[:3]])
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
