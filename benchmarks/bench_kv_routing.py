"""Routing by cached prefix: `pdserve proxy` (collocated) in front of two instances publishing KV events,
with the index on (default) and off (`--no-kv-routing`: least outstanding requests), same workload.

Workload: `--docs` documents of `--doc-tokens` tokens each (distinct random words), each first computed
by one instance only (document i warmed on instance i % 2, straight to it, not through the proxy); then
`--num-requests` requests, document i % docs + a distinct short question, `--concurrency` in flight,
through the proxy, greedy, `--output-len` tokens. Each instance's KV pool (`--num-gpu-blocks`) is sized to
hold about one document, so a document computed on the wrong instance evicts the one it held.

Reported per mode: the proxy's routing hit rate (`pdserve_proxy_kv_routing_hit_rate`: the chosen instance
held >= 90% of the longest prefix cached anywhere; only with the index on), the share of prompt tokens
the instances found cached (`vllm:prefix_cache_hits / queries`, summed over both instances, over the
measured requests), prefill tokens computed per request, TTFT p50/p99 (streamed, first content chunk).

With `--defaults` the instances run as a user types them (issue 32): vLLM's documented
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:PORT"}'`
and nothing else (the CPU default block of 128 tokens and 1 GiB pool, no replay socket, no topic). The pool
then holds every document, so least-loaded routing loses only each document's first visit to an instance.

With `--resilience` (issue 44) the index is on throughout and the same workload is measured three times,
each through a fresh proxy process: before (proxy 1), after a proxy restart (proxy 1 stopped, proxy 2
started: it must rebuild its index from the instances' snapshots, or their replay buffers), and with
`--drop-rate` of the live event messages dropped (proxy 3, PDSERVE_CHAOS_KV_EVENTS_DROP; right after it
starts, each document is recomputed on the other instance, evicting the old copy, so the index must follow
moves it partly did not hear about). Each phase's number is the instances' own prefix cache hit share
(what the routing achieved, whatever the proxy believes) and the proxy's routed outcomes. `--no-snapshots`
runs the instances without `snapshot_endpoint` (replay only, pdserve before issue 44); `--buffer-steps`
sizes their replay buffers.

    python benchmarks/bench_kv_routing.py                  # SmolLM2-135M, the embedded default model
    python benchmarks/bench_kv_routing.py --json out.json  # and the numbers as JSON
    python benchmarks/bench_kv_routing.py --defaults --num-requests 32
    python benchmarks/bench_kv_routing.py --resilience --drop-rate 0.3 --buffer-steps 64
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
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
from bench_procs import stop, wait_healthy

WORDS = ["alpha", "river", "stone", "cloud", "seven", "orange", "signal", "quiet", "market", "engine", "paper",
         "window", "garden", "silver", "thunder", "bright", "lantern", "harbor", "meadow", "copper", "violet",
         "canyon", "ember", "falcon", "glacier", "hollow", "island", "jasmine", "kettle", "lumber", "marble",
         "nectar", "orchid", "pepper", "quartz", "raven", "saddle", "timber", "umbrella", "velvet", "walnut",
         "yonder", "zephyr", "anchor", "basket", "candle", "dagger", "feather", "goblet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and len(line) > len(name) and line[len(name)] in " {":
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Proc:
    def __init__(self, name: str, cmd: list[str], logdir: Path, url: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = url
        self.log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def start_instance(name: str, args: argparse.Namespace, logdir: Path) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", *([args.model] if args.model else []), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "bench", "--disable-uvicorn-access-log"]
    if args.defaults:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    else:
        events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                  "replay_endpoint": "tcp://127.0.0.1:*"}
        if args.snapshots:
            events["snapshot_endpoint"] = "tcp://127.0.0.1:*"
        if args.buffer_steps is not None:
            events["buffer_steps"] = args.buffer_steps
        cmd += ["--max-model-len", str(args.doc_tokens + 256), "--block-size", "16",
                "--num-gpu-blocks-override", str(args.num_gpu_blocks)]
    cmd += ["--kv-events-config", json.dumps(events)]
    return Proc(name, cmd, logdir, f"http://127.0.0.1:{port}")


def start_proxy(args: argparse.Namespace, logdir: Path, urls: list[str], routing: bool, tokenizer: str | None,
                name: str | None = None, drop_rate: float = 0.0) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "proxy", "--host", "127.0.0.1", "--port", str(port), "--decode", *urls]
    if not routing:
        cmd.append("--no-kv-routing")
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    env = {"PDSERVE_CHAOS_KV_EVENTS_DROP": str(drop_rate)} if drop_rate else None
    return Proc(name or "proxy-" + ("kv" if routing else "load"), cmd, logdir, f"http://127.0.0.1:{port}", env)


async def one(session: aiohttp.ClientSession, url: str, prompt: str, output_len: int) -> float:
    """TTFT of one streamed greedy completion (seconds)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
    assert ttft is not None
    return ttft


async def drive(url: str, prompts: list[str], concurrency: int, output_len: int) -> list[float]:
    queue = list(enumerate(prompts))
    ttfts: list[float] = [0.0] * len(prompts)

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            i, prompt = queue.pop(0)
            ttfts[i] = await one(session, url, prompt, output_len)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return ttfts


def cache_counters(urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        queries += metric(text, "vllm:prefix_cache_queries_total")
        hits += metric(text, "vllm:prefix_cache_hits_total")
    return queries, hits


def run_mode(args: argparse.Namespace, routing: bool, docs: list[str], logdir: Path, tokenizer: str | None) -> dict:
    instances = [start_instance(f"inst{i}-{'kv' if routing else 'load'}", args, logdir) for i in range(2)]
    proxy = None
    try:
        for inst in instances:
            wait_healthy(inst.proc, inst.url, 600, inst.name)
        urls = [inst.url for inst in instances]
        # document i computed by instance i % 2 only
        for i, doc in enumerate(docs):
            asyncio.run(drive(urls[i % 2], [doc + " Warm up."], 1, 1))
        proxy = start_proxy(args, logdir, urls, routing, tokenizer)
        wait_healthy(proxy.proc, proxy.url, 120, proxy.name)
        if routing:  # until the proxy's index knows every warmed block
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                listing = httpx.get(proxy.url + "/pdserve/instances").json()["decode"]
                if all(inst["kv_events"]["blocks"] > 0 for inst in listing):
                    break
                time.sleep(0.2)
        rng = random.Random(1)
        prompts = [f"{docs[i % len(docs)]} Question {i}: {' '.join(rng.choices(WORDS, k=6))}?"
                   for i in range(args.num_requests)]
        q0, h0 = cache_counters(urls)
        started = time.perf_counter()
        ttfts = asyncio.run(drive(proxy.url, prompts, args.concurrency, args.output_len))
        elapsed = time.perf_counter() - started
        q1, h1 = cache_counters(urls)
        pm = httpx.get(proxy.url + "/metrics").text
        per_instance = {inst["url"]: inst["requests_total"]
                        for inst in httpx.get(proxy.url + "/pdserve/instances").json()["decode"]}
        queries, hits = q1 - q0, h1 - h0
        return {
            "mode": "kv routing (default)" if routing else "--no-kv-routing (least loaded)",
            "routing_hit_rate": metric(pm, "pdserve_proxy_kv_routing_hit_rate") if routing else None,
            "routed_hit": metric(pm, 'pdserve_proxy_kv_routed_requests_total{outcome="hit"}'),
            "routed_miss": metric(pm, 'pdserve_proxy_kv_routed_requests_total{outcome="miss"}'),
            "instance_cache_hit_share": hits / queries if queries else 0.0,
            "computed_prefill_tokens_per_request": (queries - hits) / len(prompts),
            "prompt_tokens_per_request": queries / len(prompts),
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": sorted(ttfts)[max(0, int(len(ttfts) * 0.99) - 1)],
            "elapsed_s": elapsed,
            "requests_per_instance": list(per_instance.values()),
        }
    finally:
        if proxy is not None:
            proxy.close()
        for inst in instances:
            inst.close()


def measure(proxy: Proc, urls: list[str], prompts: list[str], args: argparse.Namespace) -> dict:
    """One phase's workload through `proxy`: the instances' prefix cache hit share over it, and the proxy's
    routed outcomes and resync counters."""
    q0, h0 = cache_counters(urls)
    ttfts = asyncio.run(drive(proxy.url, prompts, args.concurrency, args.output_len))
    q1, h1 = cache_counters(urls)
    pm = httpx.get(proxy.url + "/metrics").text
    return {
        "instance_cache_hit_share": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "routed": {o: metric(pm, f'pdserve_proxy_kv_routed_requests_total{{outcome="{o}"}}')
                   for o in ("hit", "miss", "uncached")},
        "snapshots": metric(pm, "pdserve_proxy_kv_snapshots_total"),
        "resyncs": {k: metric(pm, f'pdserve_proxy_kv_resyncs_total{{kind="{k}"}}')
                    for k in ("snapshot", "replay", "clear", "reset")},
        "dropped": metric(pm, "pdserve_proxy_kv_events_dropped_total"),
        "ttft_p50_s": statistics.median(ttfts),
    }


def wait_index(proxy: Proc, timeout: float = 30.0) -> float:
    """Seconds until every instance is connected with blocks in the proxy's index (or the timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        listing = httpx.get(proxy.url + "/pdserve/instances").json()["decode"]
        if all(inst["kv_events"]["connected"] and inst["kv_events"]["blocks"] > 0 for inst in listing):
            break
        time.sleep(0.1)
    return time.monotonic() - t0


def run_resilience(args: argparse.Namespace, docs: list[str], logdir: Path, tokenizer: str | None) -> list[dict]:
    """Before / after a proxy restart / with dropped event messages (see the module's doc)."""
    instances = [start_instance(f"inst{i}-res", args, logdir) for i in range(2)]
    proxies: list[Proc] = []
    rows: list[dict] = []
    try:
        for inst in instances:
            wait_healthy(inst.proc, inst.url, 600, inst.name)
        urls = [inst.url for inst in instances]
        for i, doc in enumerate(docs):
            asyncio.run(drive(urls[i % 2], [doc + " Warm up."], 1, 1))
        rng = random.Random(1)

        def prompts(phase: int) -> list[str]:
            return [f"{docs[i % len(docs)]} Question {phase}.{i}: {' '.join(rng.choices(WORDS, k=6))}?"
                    for i in range(args.num_requests)]

        def proxy(name: str, drop_rate: float = 0.0) -> Proc:
            p = start_proxy(args, logdir, urls, True, tokenizer, name=name, drop_rate=drop_rate)
            proxies.append(p)
            wait_healthy(p.proc, p.url, 120, p.name)
            return p

        first = proxy("proxy-before")
        sync_s = wait_index(first)
        rows.append({"phase": "before", "index_sync_s": sync_s, **measure(first, urls, prompts(0), args)})
        first.close()
        time.sleep(args.restart_pause)  # the instances stay idle meanwhile: heartbeats only (with snapshots)
        second = proxy("proxy-restarted")
        sync_s = wait_index(second)
        rows.append({"phase": "after proxy restart", "index_sync_s": sync_s,
                     **measure(second, urls, prompts(1), args)})
        second.close()
        third = proxy("proxy-lossy", drop_rate=args.drop_rate)
        sync_s = wait_index(third)
        for i, doc in enumerate(docs):  # each document moves to the other instance (evicting the old copy)
            asyncio.run(drive(urls[(i + 1) % 2], [doc + " Moved."], 1, 1))
        time.sleep(2)
        rows.append({"phase": f"{args.drop_rate:.0%} of event messages dropped", "index_sync_s": sync_s,
                     **measure(third, urls, prompts(2), args)})
    finally:
        for p in proxies:
            p.close()
        for inst in instances:
            inst.close()
    return rows


def snapshot_cost() -> list[dict]:
    """The publisher thread's CPU time for KV event snapshots, in-process: recording a stored block (what every
    batch costs with snapshots on) and building + encoding a snapshot of N blocks (stores of chained runs of
    64 blocks of 16 tokens, as prompts make them)."""
    from pdserve.kv_events.events import BlockStored, KVEventBatch, encode_batch
    from pdserve.kv_events.snapshot import SnapshotRecorder

    rows = []
    for n in (10_000, 100_000):
        rec = SnapshotRecorder()
        t0 = time.process_time()
        for first in range(1, n + 1, 64):
            rec.apply(KVEventBatch(0.0, [BlockStored(list(range(first, first + 64)), None, list(range(64 * 16)), 16)]))
        t1 = time.process_time()
        size = sum(len(encode_batch(b)) for b in rec.chunks())
        t2 = time.process_time()
        rows.append({"blocks": n, "record_us_per_block": (t1 - t0) / n * 1e6, "snapshot_ms": (t2 - t1) * 1e3,
                     "snapshot_mb": size / 1e6})
    return rows


def routing_overhead(tokenizer: str) -> list[dict]:
    """The proxy's CPU time per request for routing by cached prefix, in-process: tokenizing the prompt with
    --tokenizer, then its block hashes and the index lookup (4 instances holding half of it)."""
    from pdserve.proxy.kv_index import KVIndex
    from pdserve.proxy.kv_routing import cacheable_hashes, lookup
    from pdserve.proxy.prompt_tokens import PromptTokenizer

    tok = PromptTokenizer(tokenizer, 2.0)
    rng = random.Random(2)
    rows = []
    for words in (100, 800, 3200):
        text = " ".join(rng.choices(WORDS, k=words))
        for path, body in (("/v1/completions", {"prompt": text}),
                           ("/v1/chat/completions", {"messages": [{"role": "system", "content": text},
                                                                  {"role": "user", "content": "Hi"}]})):
            ids = tok.local_ids(path, body)
            assert ids is not None
            index = KVIndex()
            sizes = {f"http://10.0.0.{i}:8000": 16 for i in range(4)}
            for url in sizes:
                index.store(url, cacheable_hashes(ids, 16)[: len(ids) // 32])
            n = 30
            t0 = time.process_time()
            for _ in range(n):
                tok.local_ids(path, body)
            t1 = time.process_time()
            for _ in range(n):
                lookup(index, ids, sizes, 1.0)
            t2 = time.process_time()
            rows.append({"route": path, "prompt_tokens": len(ids), "tokenize_ms": (t1 - t0) / n * 1000,
                         "hash_and_lookup_ms": (t2 - t1) / n * 1000})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--doc-tokens", type=int, default=1024, help="about this many tokens per document")
    parser.add_argument("--num-gpu-blocks", type=int, default=100, help="KV pool of each instance (blocks of 16)")
    parser.add_argument("--defaults", action="store_true",
                        help="instances at the product defaults: only vLLM's documented --kv-events-config")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--resilience", action="store_true",
                        help="the prefix hit rate before and after a proxy restart and with dropped event messages")
    parser.add_argument("--snapshots", action=argparse.BooleanOptionalAction, default=True,
                        help="instances serve KV event snapshots (snapshot_endpoint); --no-snapshots: replay only")
    parser.add_argument("--buffer-steps", type=int, default=None, help="the instances' replay buffer (batches)")
    parser.add_argument("--drop-rate", type=float, default=0.3, help="with --resilience: live messages dropped")
    parser.add_argument("--restart-pause", type=float, default=5.0,
                        help="with --resilience: seconds between stopping proxy 1 and starting proxy 2")
    parser.add_argument("--snapshot-cost", action="store_true",
                        help="only the publisher's CPU time to record blocks and to build and encode a snapshot")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the proxy's CPU time per request for tokenizing, hashing and the lookup")
    args = parser.parse_args()
    if args.snapshot_cost:
        print("| blocks held | recording (CPU us per block) | snapshot build + encode (CPU ms) | snapshot size (MB) |\n"
              "|---|---|---|---|")
        for r in snapshot_cost():
            print(f"| {r['blocks']:,} | {r['record_us_per_block']:.2f} | {r['snapshot_ms']:.0f} | "
                  f"{r['snapshot_mb']:.1f} |")
        return 0
    tokenizer = args.model
    if tokenizer is None:
        from pdserve.model.default_model import resolve_model

        tokenizer = str(resolve_model("smollm2-135m"))
    print("| route | prompt tokens | tokenize (CPU ms) | hashes + lookup (CPU ms) |\n|---|---|---|---|")
    for row in routing_overhead(tokenizer):
        print(f"| {row['route']} | {row['prompt_tokens']} | {row['tokenize_ms']:.2f} | "
              f"{row['hash_and_lookup_ms']:.2f} |")
    if args.overhead_only:
        return 0
    rng = random.Random(0)
    # ~1.3 tokens per word with SmolLM2's tokenizer
    docs = [f"Document {d}. " + " ".join(rng.choices(WORDS, k=int(args.doc_tokens / 1.3))) for d in range(args.docs)]
    if args.resilience:
        with tempfile.TemporaryDirectory(prefix="bench-kv-routing-") as tmp:
            rows = run_resilience(args, docs, Path(tmp), tokenizer)
        print(f"\n{args.docs} documents of ~{args.doc_tokens} tokens, {args.num_requests} requests per phase at "
              f"concurrency {args.concurrency}, pools of {args.num_gpu_blocks} blocks of 16, snapshots "
              f"{'on' if args.snapshots else 'off (replay only)'}, replay buffer "
              f"{args.buffer_steps or 10_000} batches; load average {os.getloadavg()[0]:.1f}\n")
        print("| phase | prefix tokens found cached (instances) | routed hit / miss / uncached | index synced in | "
              "snapshots installed | resyncs (snapshot, replay, clear) | messages dropped |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            rt, rs = r["routed"], r["resyncs"]
            print(f"| {r['phase']} | {r['instance_cache_hit_share']:.1%} | {rt['hit']:.0f} / {rt['miss']:.0f} / "
                  f"{rt['uncached']:.0f} | {r['index_sync_s']:.1f} s | {r['snapshots']:.0f} | "
                  f"{rs['snapshot']:.0f}, {rs['replay']:.0f}, {rs['clear']:.0f} | {r['dropped']:.0f} |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-kv-routing-") as tmp:
        for routing in (True, False):
            results.append(run_mode(args, routing, docs, Path(tmp), tokenizer))
            print(json.dumps(results[-1]), flush=True)
    print(f"\n{args.docs} documents of ~{args.doc_tokens} tokens, {args.num_requests} requests at concurrency "
          f"{args.concurrency}, {args.output_len} output tokens, "
          f"{'default pools and blocks' if args.defaults else f'pools of {args.num_gpu_blocks} blocks of 16'}; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| mode | routing hit rate | prompt tokens found cached | computed prefill tokens / request | "
          "TTFT p50 | TTFT p99 | requests per instance |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        rate = "-" if r["routing_hit_rate"] is None else f"{r['routing_hit_rate']:.1%}"
        print(f"| {r['mode']} | {rate} | {r['instance_cache_hit_share']:.1%} | "
              f"{r['computed_prefill_tokens_per_request']:.0f} of {r['prompt_tokens_per_request']:.0f} | "
              f"{r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p99_s'] * 1000:.0f} ms | {r['requests_per_instance']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
