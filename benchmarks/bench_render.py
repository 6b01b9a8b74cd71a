"""Render tier CPU cost: ms per 9,000-token chat render, and render requests/s per core over HTTP.

The seed article's numbers for vLLM's render server: ~15 ms of CPU per 9,000-token prompt, 73 requests/s
on just over one core. This measures the same two things for `pdserve render`:

1. in-process: the CPU time of one chat render (template + tokenisation + parameters) of a prompt of
   `--prompt-tokens` tokens, median over `--repeat` runs; and the derender costs (one streamed chunk with
   its state, and a batch derender of 1,000 tokens). Measured on a secondary thread, where the server
   runs them too (on glibc, tokenising on a process's main thread is ~1.5x slower);
2. over HTTP: a `pdserve render` process (`--renderer-num-workers`) under `--concurrency` clients for
   `--requests` renders; requests/s, the CPU seconds the server (and its workers) used, and so requests/s
   per core = requests / CPU seconds.

    python benchmarks/bench_render.py                      # embedded SmolLM2 tokenizer and template
    python benchmarks/bench_render.py --workers 2 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from bench_procs import stop, wait_healthy

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
         "whiskey", "xray", "yankee", "zulu"]


def make_prompt(tokenizer: Any, n_tokens: int) -> str:
    """Deterministic prose of about n_tokens tokens (numbers keep it from being one repeated token)."""
    parts: list[str] = []
    i = 0
    text = ""
    while True:
        parts.append(f"{WORDS[i % len(WORDS)]} {i} ")
        i += 1
        if i % 256 == 0:
            text = "".join(parts)
            if len(tokenizer.encode(text, add_special_tokens=False)) >= n_tokens:
                break
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids, skip_special_tokens=True)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its waited-for children, plus its live children (worker processes)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def stat(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return sum(int(f) for f in fields[11:15]) / ticks  # utime stime cutime cstime

    total = stat(pid)
    for child in Path("/proc").iterdir():
        if child.name.isdigit():
            try:
                ppid = int(Path(f"/proc/{child.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                total += stat(int(child.name))
    return total


def in_process(model_dir: Path, prompt_tokens: int, repeat: int) -> dict[str, float]:
    from pdserve.render.context import RenderConfig, RenderContext

    ctx = RenderContext(RenderConfig.from_model_dir(model_dir, served_model_names=["m"],
                                                    max_model_len=prompt_tokens + 1024))
    text = make_prompt(ctx.tokenizer, prompt_tokens)
    out_ids = ctx.tokenizer.encode(make_prompt(ctx.tokenizer, 1000), add_special_tokens=False)[:1000]
    with ThreadPoolExecutor(1) as thread:  # a fresh thread, as the server's render worker
        return thread.submit(_measure, ctx, text, out_ids, repeat).result()


def _measure(ctx: Any, text: str, out_ids: list[int], repeat: int) -> dict[str, float]:
    """Process CPU time (all threads: the tokenizer may use its own), while the main thread only waits."""
    from pdserve.render.derender import derender_chat
    from pdserve.render.render import render_chat

    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    n = len(render_chat(ctx, body)["token_ids"])
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        render_chat(ctx, body)
        times.append(time.process_time() - t0)
    chunk_times = []
    state = None
    for t in out_ids[:300]:
        req = {"stream": True, "stream_state": state, "chat_request": {"messages": body["messages"][-1:]},
               "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [t]}]}}
        t0 = time.process_time()
        state = derender_chat(ctx, req)["stream_state"]
        chunk_times.append(time.process_time() - t0)
    batch = {"chat_request": {"messages": body["messages"][-1:]},
             "generate_response": {"request_id": "r", "choices": [{"index": 0, "token_ids": out_ids,
                                                                   "finish_reason": "length"}]}}
    t0 = time.process_time()
    for _ in range(10):
        derender_chat(ctx, batch)
    batch_ms = (time.process_time() - t0) / 10 * 1000
    return {"prompt_tokens": n, "render_ms_median": statistics.median(times) * 1000,
            "render_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1000,
            "derender_chunk_ms_median": statistics.median(chunk_times[10:]) * 1000,
            "derender_batch_1000_tokens_ms": batch_ms}


async def http_load(url: str, body: dict[str, Any], requests: int, concurrency: int) -> tuple[float, int]:
    payload = json.dumps(body).encode()
    errors = 0
    next_i = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal errors, next_i
        while next_i < requests:
            next_i += 1
            r = await c.post(url + "/v1/chat/completions/render", content=payload,
                             headers={"content-type": "application/json"})
            if r.status_code != 200:
                errors += 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
        return time.perf_counter() - t0, errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def over_http(model: str, model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    from pdserve.text.tokenizer import load_tokenizer

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "render", model, "--host", "127.0.0.1", "--port",
                             str(port), "--served-model-name", "m", "--max-model-len",
                             str(args.prompt_tokens + 1024), "--renderer-num-workers", str(args.workers),
                             "--disable-uvicorn-access-log", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, 120, "pdserve render", poll_s=0.2)
        text = make_prompt(load_tokenizer(model_dir), args.prompt_tokens)
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
        asyncio.run(http_load(url, body, min(20, args.requests), args.concurrency))  # warm-up
        cpu0 = cpu_seconds(proc.pid)
        wall, errors = asyncio.run(http_load(url, body, args.requests, args.concurrency))
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        stop(proc, grace_s=20)
    return {"requests": args.requests, "errors": errors, "wall_s": wall, "requests_per_s": args.requests / wall,
            "server_cpu_s": cpu, "cores_used": cpu / wall, "requests_per_s_per_core": args.requests / cpu,
            "server_cpu_ms_per_request": cpu / args.requests * 1000}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model folder or embedded name (tokenizer + template)")
    p.add_argument("--prompt-tokens", type=int, default=9000)
    p.add_argument("--repeat", type=int, default=30, help="in-process renders to time")
    p.add_argument("--requests", type=int, default=300, help="HTTP renders to time")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--workers", type=int, default=1, help="--renderer-num-workers of the render server")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()

    from pdserve.render.cli import resolve_model_folder

    model_dir = resolve_model_folder(args.model)
    local = in_process(model_dir, args.prompt_tokens, args.repeat)
    remote = over_http(args.model, model_dir, args)
    result = {"in_process": local, "http": remote, "workers": args.workers, "concurrency": args.concurrency,
              "cpu_count": os.cpu_count(), "torch_imported": "torch" in sys.modules}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"pdserve render, {local['prompt_tokens']}-token chat prompt ({args.model}), {os.cpu_count()} CPUs")
    print(f"  render CPU per request (in-process) : {local['render_ms_median']:.1f} ms median, "
          f"{local['render_ms_p90']:.1f} ms p90")
    print(f"  derender, one streamed chunk        : {local['derender_chunk_ms_median']:.3f} ms median")
    print(f"  derender, batch of 1,000 tokens     : {local['derender_batch_1000_tokens_ms']:.1f} ms")
    print(f"  HTTP, {args.workers} worker(s), {args.concurrency} clients : {remote['requests_per_s']:.1f} req/s "
          f"on {remote['cores_used']:.2f} cores ({remote['errors']} errors)")
    print(f"  HTTP, server CPU per request        : {remote['server_cpu_ms_per_request']:.1f} ms")
    print(f"  HTTP, requests/s per core           : {remote['requests_per_s_per_core']:.1f}")
    print(f"  torch imported by the benchmark     : {result['torch_imported']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
