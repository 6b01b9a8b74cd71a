"""pdserve vs vLLM's CPU build, served side by side on this machine, same prompts, float32 both.

    python benchmarks/bench_vllm_cpu.py --install-vllm          # installs vllm-cpu into --vllm-venv first
    python benchmarks/bench_vllm_cpu.py --rounds 3 --concurrency 4 16
    python benchmarks/bench_vllm_cpu.py --no-vllm --pdserve-variant t2=PDSERVE_CPU_THREADS=2
        # pdserve against itself with another setting (thread counts A/B), alternated the same way

Both servers load the embedded SmolLM2-135M-Instruct (the HF folder pdserve converts from its GGUF) with
`--dtype float32` and prefix caching off (every round sends the same prompts). Both stay up for the whole
run and idle while the other is measured; the `pdserve bench serve` client (random dataset, 512 in / 64
out by default, ignore_eos, temperature 0) is pointed at one, then the other, alternating which goes first
from round to round. Each run records the 1-minute load average before it starts: on a shared machine the
ratios within a round are what to read, not the absolute numbers.

Prints per-run rows and, per concurrency, the medians over rounds and the ratios pdserve / vLLM of output
tokens/s (goal >= 1.0) and of ITL p50 (goal <= 1.0), and (Linux) each server's CPU time per output token
over its process tree (HTTP server included), which the load of other jobs does not move the way it moves
wall-clock rates. `--result FILE` writes everything as JSON.

vLLM is installed by `benchmarks/vllm_cpu_venv.py` (what it changes from a plain pip install is written
there). `--pdserve-arg` / `--vllm-arg` pass extra server flags; `--pdserve-env` extra environment
(e.g. PDSERVE_CPU_THREADS=1,2); `--pdserve-variant NAME=KEY=VALUE[;KEY=VALUE]` adds another pdserve server
with that environment on top, measured in the same rotation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_procs import stop, wait_healthy
from bench_server import free_port
from step_log_summary import window_stats

HERE = Path(__file__).resolve().parent


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    step_log: Path | None = None  # pdserve's PDSERVE_STEP_LOG


def start_pdserve(model_dir: Path, port: int, log_dir: Path, extra: list[str], env_extra: dict[str, str],
                  name: str = "pdserve") -> Server:
    log = log_dir / f"{name}.log"
    steps = log_dir / f"{name}-steps.jsonl"  # the step log: where the engine thread's time went, per run
    cmd = [sys.executable, "-m", "pdserve", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--no-enable-prefix-caching", "--disable-uvicorn-access-log", *extra]
    env = {**os.environ, "PDSERVE_STEP_LOG": str(steps), **env_extra}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return Server(name, f"http://127.0.0.1:{port}", proc, log, steps)


def start_vllm(venv: Path, model_dir: Path, port: int, log_dir: Path, extra: list[str]) -> Server:
    log = log_dir / "vllm.log"
    cmd = [str(venv / "bin" / "vllm-serve"), str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--no-enable-prefix-caching", "--disable-uvicorn-access-log", *extra]
    # 1 GiB of KV cache (vLLM's CPU default is sized for servers; 16 x 576 tokens need 0.4 GiB); no usage reports.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return Server("vllm", f"http://127.0.0.1:{port}", proc, log)


def load_average() -> float:
    return os.getloadavg()[0]


def _tree_pids(pid: int) -> list[int]:
    """pid and its descendant processes (Linux /proc; each process's stat covers all its threads)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # exited meanwhile
                todo.extend(int(c) for c in children.read_text().split())
    return pids


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds used so far by a server's process tree (None off Linux). Under a shared
    machine's load, a server's CPU time per generated token is what its wall-clock numbers cannot show."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = 0
    for p in _tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (the client runs are its children)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_client(server: Server, model_dir: Path, concurrency: int, args: argparse.Namespace, out_dir: Path,
               tag: str) -> dict:
    name = f"{tag}.json"
    cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", server.url, "--tokenizer", str(model_dir),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    load = load_average()
    cpu0 = cpu_seconds(server.proc.pid)
    t0 = time.monotonic()
    client0 = _children_cpu_s()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.client_timeout)
    t1 = time.monotonic()
    client_cpu_s = _children_cpu_s() - client0  # the load client's own CPU, on the same cores
    cpu1 = cpu_seconds(server.proc.pid)
    data = json.loads((out_dir / name).read_text())
    if data["failed"]:
        raise RuntimeError(f"{server.name}: {data['failed']} requests failed: {data['errors'][:3]}")
    cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return {"server": server.name, "concurrency": concurrency, "load_avg_1m": load,
            "server_cpu_s": cpu_s, "client_cpu_s": client_cpu_s,
            "cpu_ms_per_output_token": None if cpu_s is None else 1000 * cpu_s / data["total_output_tokens"],
            "wall_s": time.monotonic() - t0, "output_tok_s": data["output_throughput"],
            "ttft_p50_ms": data["median_ttft_ms"], "itl_p50_ms": data["median_itl_ms"],
            "itl_p99_ms": data["p99_itl_ms"], "tpot_p50_ms": data["median_tpot_ms"],
            # the same clock as the step log's (CLOCK_MONOTONIC on Linux)
            "steps": window_stats(str(server.step_log), t0, t1) if server.step_log is not None else {}}


def summarise(runs: list[dict], names: list[str]) -> list[dict]:
    """Per concurrency: each server's medians over rounds and, against vLLM (when it ran), each other
    server's per-round ratios (the two halves of a round saw nearly the same load) and their median."""
    rows = []
    rounds = sorted({r["round"] for r in runs})
    for c in sorted({r["concurrency"] for r in runs}):
        row: dict = {"concurrency": c}
        for n in names:
            mine = [r for r in runs if r["server"] == n and r["concurrency"] == c]
            for key in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "load_avg_1m"):
                row[f"{n}_{key}"] = statistics.median(r[key] for r in mine)
        base = "vllm" if "vllm" in names else names[0]
        for n in names:
            if n == base:
                continue
            tok = [_pick(runs, n, c, k)["output_tok_s"] / _pick(runs, base, c, k)["output_tok_s"] for k in rounds]
            itl = [_pick(runs, n, c, k)["itl_p50_ms"] / _pick(runs, base, c, k)["itl_p50_ms"] for k in rounds]
            row[f"{n}_vs_{base}_tok_s_per_round"] = tok
            row[f"{n}_vs_{base}_itl_p50_per_round"] = itl
            cpu = [_pick(runs, n, c, k)["cpu_ms_per_output_token"] for k in rounds]
            cpu_base = [_pick(runs, base, c, k)["cpu_ms_per_output_token"] for k in rounds]
            if None not in cpu and None not in cpu_base:
                row[f"{n}_vs_{base}_cpu_per_token_per_round"] = [a / b for a, b in zip(cpu, cpu_base, strict=True)]
            row[f"{n}_vs_{base}_tok_s"] = statistics.median(tok)
            row[f"{n}_vs_{base}_itl_p50"] = statistics.median(itl)
        rows.append(row)
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _thread_line(st: dict) -> str:
    """Where pdserve's stepping thread's wall time went during a run (seconds), and its step mix."""
    parts = []
    for where in ("step", "gap"):
        parts.append(f"{'in steps' if where == 'step' else 'between'}: cpu {st[f'{where}_run_s']:.1f} "
                     f"runq {st[f'{where}_rq_s']:.1f} blocked {st[f'{where}_blocked_s']:.1f} "
                     f"(others' cpu {st[f'{where}_other_run_s']:.1f})")
    return (f"        engine thread s {'; '.join(parts)}; steps {st['steps']} (mixed {st['mixed_steps']}, "
            f"prefill-only {st['prefill_only_steps']}, on >1 thread {st['multi_thread_steps']}), "
            f"decode step p50 {st['decode_step_p50_ms']:.1f} ms "
            f"at {st['decode_seqs_p50']} seqs")


def _pick(runs: list[dict], name: str, c: int, rnd: int) -> dict:
    return next(r for r in runs if r["server"] == name and r["concurrency"] == c and r["round"] == rnd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", type=Path, default=Path(tempfile.gettempdir()) / "vllm-venv")
    ap.add_argument("--install-vllm", action="store_true", help="install vllm-cpu into --vllm-venv if missing")
    ap.add_argument("--no-vllm", action="store_true", help="measure pdserve alone")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pdserve-arg", action="append", default=[])
    ap.add_argument("--pdserve-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--pdserve-variant", action="append", default=[], metavar="NAME=KEY=VALUE[;KEY=VALUE]")
    ap.add_argument("--vllm-arg", action="append", default=[])
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument("--client-timeout", type=float, default=1800)
    ap.add_argument("--result", type=Path, default=None, help="write runs and summary as JSON")
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")
    args = ap.parse_args()

    from pdserve.model.default_model import resolve_model

    model_dir = resolve_model(None)
    if not args.no_vllm and not (args.vllm_venv / "bin" / "vllm-serve").is_file():
        if not args.install_vllm:
            sys.exit(f"no vLLM in {args.vllm_venv}: pass --install-vllm (or --no-vllm)")
        from vllm_cpu_venv import install

        install(args.vllm_venv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-vllm-cpu-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env_extra = dict(kv.split("=", 1) for kv in args.pdserve_env)

    servers: list[Server] = []
    try:
        servers.append(start_pdserve(model_dir, free_port(), log_dir, args.pdserve_arg, env_extra))
        for variant in args.pdserve_variant:
            name, _, settings = variant.partition("=")
            env = {**env_extra, **dict(kv.split("=", 1) for kv in settings.split(";") if kv)}
            servers.append(start_pdserve(model_dir, free_port(), log_dir, args.pdserve_arg, env, name))
        if not args.no_vllm:
            servers.append(start_vllm(args.vllm_venv, model_dir, free_port(), log_dir, args.vllm_arg))
        for s in servers:  # started together, waited for in turn: vLLM's start-up dominates
            wait_healthy(s.proc, s.url, args.start_timeout, s.name, poll_s=2)
            print(f"{s.name} ready at {s.url} (log {s.log})", flush=True)
        runs: list[dict] = []
        print(f"{'round':>5} {'server':>8} {'conc':>4} {'load':>5} {'out tok/s':>9} {'TTFT p50':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'CPU ms/out tok':>14}", flush=True)
        for rnd in range(args.rounds):
            for c in args.concurrency:
                order = servers if rnd % 2 == 0 else servers[::-1]
                for s in order:
                    r = run_client(s, model_dir, c, args, log_dir, f"r{rnd}-{s.name}-c{c}")
                    r["round"] = rnd
                    runs.append(r)
                    print(f"{rnd:>5} {s.name:>8} {c:>4} {r['load_avg_1m']:>5.1f} {r['output_tok_s']:>9.1f} "
                          f"{r['ttft_p50_ms']:>7.0f}ms {r['itl_p50_ms']:>6.1f}ms {r['itl_p99_ms']:>6.1f}ms "
                          f"{_fmt(r['cpu_ms_per_output_token']):>14}", flush=True)
                    if r["steps"].get("step_run_s") is not None:
                        print(_thread_line(r["steps"]) + f"; client CPU {r['client_cpu_s']:.1f} s in "
                              f"{r['wall_s']:.0f} s", flush=True)
    finally:
        for s in servers:
            stop(s.proc)
    names = [s.name for s in servers]
    summary = summarise(runs, names)
    print()
    for row in summary:
        c = row["concurrency"]
        for n in names:
            print(f"concurrency {c}: {n:>8} {row[f'{n}_output_tok_s']:6.1f} tok/s, ITL p50 "
                  f"{row[f'{n}_itl_p50_ms']:6.1f} ms, TTFT p50 {row[f'{n}_ttft_p50_ms']:6.0f} ms (median of rounds)")
        for key in row:
            if key.endswith("_tok_s_per_round"):
                pair = key.removesuffix("_tok_s_per_round")
                rounds_tok = ", ".join(f"{x:.2f}" for x in row[key])
                rounds_itl = ", ".join(f"{x:.2f}" for x in row[f"{pair}_itl_p50_per_round"])
                print(f"concurrency {c}: {pair}: output tok/s {row[f'{pair}_tok_s']:.2f}x (rounds {rounds_tok}), "
                      f"ITL p50 {row[f'{pair}_itl_p50']:.2f}x (rounds {rounds_itl})")
                cpu = row.get(f"{pair}_cpu_per_token_per_round")
                if cpu:
                    print(f"concurrency {c}: {pair}: server CPU time per output token, rounds "
                          f"{', '.join(f'{x:.2f}' for x in cpu)}x")
    if args.result:
        args.result.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                           "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
