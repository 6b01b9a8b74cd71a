"""Multi-turn over P/D with and without reading the conversation back from the decode instance.

One prefill and one decode instance (`pdserve serve`, NIXL over DRAM) behind `pdserve proxy`, driven by
`pdserve bench --dataset-name multiturn` (synthetic conversations over the chat API: a shared system prompt,
`--turns` user messages, answers of `--answer-len` tokens, all conversations side by side). Modes:

- `on`: both instances with `bidirectional_kv_xfer` (the decode instance keeps each turn's conversation, the
  next turn's prefill reads it back and computes only the new tokens), `kv_recompute_threshold` as given;
- `off`: the same without it: the prefill instance recomputes what its own prefix cache lacks (the answers,
  which the decode instance generated; its cache still holds its previous prompts);
- `off-nocache` (with `--with-nocache`): also no prefix cache on the prefill instance (every turn recomputes
  the whole history: what a fleet whose prefill caches cannot hold every conversation converges to).

Per mode it reports the bench's per-turn table (TTFT, prompt, new, cached and computed prefill tokens) and
writes one JSON per mode plus a TTFT-by-turn plot of all modes.

Mode `on` also checks the proxy's pull-or-recompute choice per turn (`--no-cost-check` to skip): the proxy's
log gives each turn's decision and prediction (`X-PDServe-KV-History`: tokens, pull_ms, recompute_ms), the
prefill instance's log the measured read-back time of that turn ("read N held prompt tokens back in X ms"),
and once the conversations are done the same prefill instance is timed recomputing that many tokens (fresh
random prompts of N + 1 and of 1 token, `max_tokens` 1, the difference, median of 3). A turn whose choice
was slower than the other, as measured, is flagged WRONG.

    python benchmarks/bench_multiturn.py --out-dir benchmarks/results/multiturn-cpu
    python benchmarks/bench_multiturn.py --system-len 4096 --out-dir ...    # a long shared history
    python benchmarks/bench_multiturn.py --model Llama-3.1-8B --serve-arg=--load-format --serve-arg=dummy \
        --serve-arg=--gpu-memory-utilization --serve-arg=0.4 --tokenizer TOK --out-dir ...   # one GPU, P and D
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_procs import stop, wait_healthy

MODES = ("on", "off", "off-nocache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, cmd: list[str], logdir: Path, url: str, env: dict[str, str]) -> None:
        self.name = name
        self.url = url
        self.log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def kv_config(role: str, bidirectional: bool, threshold: int) -> str:
    extra = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": threshold} if bidirectional else {}
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def start_instance(name: str, role: str, mode: str, args: argparse.Namespace, logdir: Path, env: dict) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", *([args.model] if args.model else []), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "bench", "--disable-uvicorn-access-log",
           "--max-model-len", str(args.max_model_len), "--block-size", "16",
           "--kv-transfer-config", kv_config(role, mode == "on", args.kv_recompute_threshold), "--side-channel-port", str(free_port())]
    if args.num_gpu_blocks:
        cmd += ["--num-gpu-blocks-override", str(args.num_gpu_blocks)]
    if mode == "off-nocache" and role == "kv_producer":
        cmd.append("--no-enable-prefix-caching")
    cmd += args.serve_arg
    return Proc(f"{name}-{mode}", cmd, logdir, f"http://127.0.0.1:{port}", env)


def run_mode(mode: str, args: argparse.Namespace, out_dir: Path, logdir: Path) -> dict:
    env = {"PDSERVE_KV_SECRET": "bench-multiturn-" + os.urandom(8).hex()}
    procs = [start_instance("prefill", "kv_producer", mode, args, logdir, env),
             start_instance("decode", "kv_consumer", mode, args, logdir, env)]
    try:
        for p in procs:
            wait_healthy(p.proc, p.url, 900, p.name)
        port = free_port()
        proxy = Proc(f"proxy-{mode}", [sys.executable, "-m", "pdserve", "proxy", "--host", "127.0.0.1", "--port",
                                       str(port), "--prefill", procs[0].url, "--decode", procs[1].url,
                                       *args.proxy_arg],
                     logdir, f"http://127.0.0.1:{port}", {})
        procs.append(proxy)
        wait_healthy(proxy.proc, proxy.url, 120, proxy.name)
        cmd = [sys.executable, "-m", "pdserve", "bench", "--base-url", proxy.url, "--model", "bench",
               "--dataset-name", "multiturn", "--num-prompts", str(args.conversations),
               "--multiturn-turns", str(args.turns), "--multiturn-system-len", str(args.system_len),
               "--multiturn-user-len", str(args.user_len), "--multiturn-answer-len", str(args.answer_len),
               "--multiturn-think-time", str(args.think_time), "--temperature", "0", "--label", mode,
               "--save-result", "--result-dir", str(out_dir), "--result-filename", f"multiturn-{mode}.json"]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        if args.max_concurrency:
            cmd += ["--max-concurrency", str(args.max_concurrency)]
        t0 = time.monotonic()
        subprocess.run(cmd, check=True)
        print(f"mode {mode}: {time.monotonic() - t0:.1f} s")
        result = json.loads((out_dir / f"multiturn-{mode}.json").read_text())
        if mode == "on" and args.cost_check:
            result["cost_check"] = check_costs(procs[0], logdir / f"proxy-{mode}.log", logdir / f"prefill-{mode}.log")
            (out_dir / f"multiturn-{mode}.json").write_text(json.dumps(result, indent=1))
        return result
    finally:
        for p in reversed(procs):
            p.close()


_DECISION = re.compile(r"request (\S+): held history of (\d+) tokens on \S+: (\w+) \((.*)\)$")
_READ = re.compile(r"request (\S+): read (\d+) held prompt tokens back in ([\d.]+) ms")


def _recompute_ms(url: str, tokens: int, repeats: int = 3) -> float:
    """Time the prefill instance computing `tokens` more prompt tokens: fresh random prompts (nothing cached)
    of tokens + 1 and of 1 token, max_tokens 1; the median difference."""
    import httpx

    def once(n: int) -> float:
        prompt = [random.randrange(1000, 40_000) for _ in range(n)]
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"model": "bench", "prompt": prompt, "max_tokens": 1},
                       timeout=300)
        r.raise_for_status()
        return time.perf_counter() - t0

    return statistics.median(once(tokens + 1) - once(1) for _ in range(repeats)) * 1e3


def check_costs(prefill: Proc, proxy_log: Path, prefill_log: Path) -> list[dict]:
    """Per turn that had a held history: the proxy's choice and prediction beside the measured costs."""
    reads = {m.group(1): float(m.group(3)) for m in _READ.finditer(prefill_log.read_text(errors="replace"))}
    rows = []
    for line in proxy_log.read_text(errors="replace").splitlines():
        m = _DECISION.search(line)
        if m is None:
            continue
        fields = dict(kv.split("=", 1) for kv in m.group(4).split("; ") if "=" in kv)
        tokens = int(fields.get("tokens", 0))
        row = {"request": m.group(1), "decision": m.group(3), "held": int(m.group(2)), "tokens": tokens,
               "predicted_pull_ms": float(fields.get("pull_ms", "nan")),
               "predicted_recompute_ms": float(fields.get("recompute_ms", "nan")),
               "measured_pull_ms": next((ms for rid, ms in reads.items() if m.group(1) in rid), None)}
        row["measured_recompute_ms"] = _recompute_ms(prefill.url, tokens) if tokens > 0 else 0.0
        pull, recompute = row["measured_pull_ms"], row["measured_recompute_ms"]
        if pull is not None and tokens > 0:
            row["right"] = (pull <= recompute) == (row["decision"] == "pull")
        rows.append(row)
    print(f"{'turn':>4} {'decision':>9} {'tokens':>6} {'pred pull':>10} {'pred recomp':>11} {'meas pull':>10} "
          f"{'meas recomp':>11}")
    for i, r in enumerate(rows, 1):
        pull = f"{r['measured_pull_ms']:.1f}" if r["measured_pull_ms"] is not None else "-"
        print(f"{i:>4} {r['decision']:>9} {r['tokens']:>6} {r['predicted_pull_ms']:>10.1f} "
              f"{r['predicted_recompute_ms']:>11.1f} {pull:>10} {r['measured_recompute_ms']:>11.1f}"
              + ("" if r.get("right", True) else "  WRONG"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or name (default: pdserve's embedded SmolLM2)")
    ap.add_argument("--tokenizer", default=None, help="for the bench client (default: the server's model folder)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=128)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--think-time", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--kv-recompute-threshold", type=int, default=0,
                    help="mode on: read back a held prefix from this many missing tokens on (vLLM's default is "
                         "64, its bidirectional benchmark configs use 0; the proxy's pull-or-recompute "
                         "arithmetic decides per turn either way) (default 0)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more `pdserve serve` argument for both instances (repeat; e.g. "
                         "--serve-arg=--load-format --serve-arg=dummy)")
    ap.add_argument("--modes", default="on,off", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--no-cost-check", dest="cost_check", action="store_false",
                    help="mode on: skip checking the proxy's per-turn pull-or-recompute choice against measured costs")
    ap.add_argument("--proxy-arg", action="append", default=[],
                    help="one more `pdserve proxy` argument (repeat; e.g. --proxy-arg=--kv-history-prefill-tps "
                         "--proxy-arg=500)")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logdir = out_dir / "logs"
    logdir.mkdir(exist_ok=True)
    from pdserve.bench.multiturn import TurnSummary, plot_ttft_by_turn

    results = {m: run_mode(m, args, out_dir, logdir) for m in modes}
    series = {m: [TurnSummary(**t) for t in r["turns"]] for m, r in results.items()}
    plot = plot_ttft_by_turn(series, str(out_dir / "ttft-by-turn.png"),
                             f"TTFT by turn: {args.conversations} conversations, system {args.system_len}, "
                             f"user {args.user_len}, answer {args.answer_len}")
    print(f"{'turn':>4} " + " ".join(f"{m + ' TTFT p50':>18} {m + ' computed/new':>18}" for m in modes))
    for i in range(args.turns):
        row = []
        for m in modes:
            t = series[m][i] if i < len(series[m]) else None
            row.append(f"{t.ttft_p50_ms if t else float('nan'):>18.1f} "
                       f"{(t.computed_over_new if t and t.computed_over_new is not None else float('nan')):>18.2f}")
        print(f"{i:>4} " + " ".join(row))
    print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
