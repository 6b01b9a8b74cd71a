"""Fidelity of `pdserve sim`: predicted against measured, the same profile and workload, in one run.

For each topology: `pdserve up` starts it (the embedded model on the CPU box by default); `pdserve profile
--url` measures each role's instance of that very deployment (one per role: collocated, or prefill and
decode), plus the deployment's own HTTP path (a tiny prompt through the proxy against the same prompt sent
to the instance directly: the proxy hop, and for P/D the handoff's fixed cost); then at each rate `pdserve
bench serve` measures the deployment and `pdserve sim` predicts it from those profiles with the same flags
(the same seeded lengths and arrivals). Every point is reported, with its relative error.

The CPU box is shared: the CPU share an instance gets moves by 2x within minutes. So each point is predicted
twice: from the profile as measured ("predicted"), and with its step costs scaled by the box's speed right
before the point ("calibrated": a workload-sized prompt's TTFT now over the same probe right after profiling).

    python benchmarks/sim_validate.py --topologies collocated:1,1p1d --rates 0.25,0.6,1.5 --num-prompts 12 \\
        --input-len 128 --output-len 16 --out benchmarks/results/sim-validate-cpu

On one GPU (`--gpu`): the packaged shape of `--model` with random weights (`--load-format dummy`), collocated with
`--gpu-mem` of the GPU's memory and 1P1D with half of it each on the same GPU (the split BENCHMARKS.md's
"Goodput on one H200" measured), the profile's measurements sized for long prompts. The seed's RAG shape at the
rates measured there, both topologies in one call of under 8 minutes (results.json is written after each point):

    python benchmarks/sim_validate.py --gpu --model Llama-3.1-8B --tokenizer TOKENIZER_DIR \\
        --topologies collocated:1,1p1d --rates 0.25,0.5 --num-prompts 12 --input-len 28000 --output-len 650 \\
        --goodput "ttft:2500 tpot:45" --out "$OUT"

`--dry-run` prints each topology's `pdserve up` command and the bench workload, and launches nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.launcher import LaunchedTopology
from pdserve.bench.options import BenchSpec
from pdserve.launch.config import parse_topology
from pdserve.sim import profiler
from pdserve.sim.profile import refit
from pdserve.sim.report import bench_result
from pdserve.sim.run import Pools, simulate
from pdserve.sim.workload import bench_jobs

KEYS = (("median_ttft_ms", "TTFT p50"), ("p90_ttft_ms", "TTFT p90"), ("mean_tpot_ms", "mean TPOT"),
        ("request_goodput", "goodput"), ("request_throughput", "throughput"))


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - the local deployment we started
        return json.loads(r.read())


def profile_instance(url: str, args: argparse.Namespace, name: str) -> Any:
    m = profiler.HttpMeasure(url)
    m.run(m._start())
    base = m.prefill(1, 0, np.random.default_rng(1))
    pre, dec = profiler.measure(m, prefill_lens=args.prefill_lens, cached_lens=[0], decode_batches=args.decode_batches,
                                decode_contexts=args.decode_contexts, decode_steps=6,
                                log=lambda s: print(f"  [{name}] {s}", flush=True))
    path = profiler.http_path_s(base, dec)
    for p in pre:
        p["seconds"] = max(p["seconds"] - path, 1e-6)
    settings, _ = profiler.http_settings(m.info)  # the instance's own scheduler settings
    prof = profiler.base_profile(name, str(m.info.get("model", m.model)), str(m.info.get("device", "cpu")), m.kv(),
                                 settings, int(m.info.get("tensor_parallel_size", 1)),
                                 str(m.info.get("kv_cache_dtype", "auto")))
    prof.prefill_points, prof.decode_points = pre, dec
    prof.overheads.ingress_s = prof.overheads.egress_s = path / 2
    # the instances share the host (CPU) or the GPU (--gpu): the READ is a copy there
    prof.handoff.link_bytes_per_s = profiler.copy_rate(256 << 20, str(m.info.get("device", "cpu")))
    refit(prof)
    prof.notes = [f"measured over HTTP by benchmarks/sim_validate.py; one-token TTFT {base * 1e3:.1f} ms, HTTP path "
                  f"{path * 1e3:.1f} ms",
                  f"load average {profiler.load_average()}"]
    return prof, base


def probe(url: str, prompt_len: int) -> float:
    """The box's speed now: the best of two TTFTs of a workload-sized prompt sent to an instance directly."""
    m = profiler.HttpMeasure(url)
    m.run(m._start())
    return min(m.prefill(prompt_len, 0, np.random.default_rng(100 + i)) for i in range(2))


def scaled(pools: Pools, factor: float) -> Pools:
    """The pools' profiles with every step cost times `factor` (the CPU share the shared box gives now)."""
    def one(p: Any) -> Any:
        q = p.from_json(json.loads(json.dumps(p.to_json())))
        q.step_model = {k: v * factor for k, v in p.step_model.items()}
        return q
    return Pools(one(pools.prefill), one(pools.decode), one(pools.collocated))


def tiny_ttft(url: str, n: int = 3) -> float:
    m = profiler.HttpMeasure(url)
    m.run(m._start())
    return min(m.prefill(1, 0, np.random.default_rng(7 + i)) for i in range(n))


def spec_for(url: str, args: argparse.Namespace, rate: float) -> BenchSpec:
    spec = BenchSpec(base_url=url, dataset_name="random", num_prompts=args.num_prompts,
                     random_input_len=args.input_len, random_output_len=args.output_len, request_rate=rate,
                     seed=args.seed, temperature=0.0, metric_percentiles="50,90,99",
                     goodput=args.goodput.split(), disable_tqdm=True, model=args.model_name,
                     tokenizer=args.tokenizer, no_align_prompts=True)
    spec.normalise()
    return spec


def gpu_defaults(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """--gpu: what was not given explicitly, set for one GPU and long prompts."""
    if not args.gpu:
        if args.up_arg is None:
            args.up_arg = ["--serve-arg=--cpu-kv-cache-gb 0.25"]
        return
    half = round(args.gpu_mem / 2, 4)
    if args.up_arg is None:
        args.up_arg = ["--gpus", "0", f"--collocated-arg=--gpu-memory-utilization={args.gpu_mem}",
                       f"--prefill-arg=--gpu-memory-utilization={half}",
                       f"--decode-arg=--gpu-memory-utilization={half}", "--startup-timeout", "400"]
    args.load_format = args.load_format or "dummy"
    # the profile's points: prompts up to the workload's, decode batches that fit half a GPU at long contexts
    for name, value in (("prefill_lens", [1024, 8192, max(args.input_len, 8192)]), ("decode_batches", [1, 4]),
                        ("decode_contexts", [1024, args.input_len])):
        if getattr(args, name) == ap.get_default(name):
            setattr(args, name, value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topologies", default="collocated:1,1p1d")
    ap.add_argument("--rates", default="0.25,0.6,1.5")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--goodput", default="ttft:4000 tpot:1000")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="MODEL for pdserve up (default: the embedded model)")
    ap.add_argument("--prefill-lens", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128, 256])
    ap.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--decode-contexts", type=lambda s: [int(x) for x in s.split(",")], default=[32, 144])
    ap.add_argument("--out", default="benchmarks/results/sim-validate-cpu")
    ap.add_argument("--up-arg", action="append", default=None,
                    help="extra `pdserve up` arguments (default on the CPU: a 0.25 GiB KV pool per instance, the box "
                         "is shared; with --gpu: GPU 0, the memory split of --gpu-mem)")
    ap.add_argument("--gpu", action="store_true",
                    help="one GPU: --load-format dummy, collocated at --gpu-mem of its memory, 1P1D at half each; "
                         "the profile's points sized for long prompts (unless given)")
    ap.add_argument("--gpu-mem", type=float, default=0.84, help="--gpu: each side's share of the GPU's memory")
    ap.add_argument("--load-format", default=None, help="pdserve serve --load-format (--gpu: dummy)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer folder for the servers and the bench (a dummy shape has none; default: the model's "
                         "folder, or the embedded model's for a dummy shape)")
    ap.add_argument("--dry-run", action="store_true", help="print the launch commands and the workload, run nothing")
    args = ap.parse_args()
    gpu_defaults(args, ap)
    from pdserve.bench.runner import run_serve
    from pdserve.model.default_model import DEFAULT_MODEL, resolve_model
    from pdserve.model.model_dir import resolve_model_dir

    model = args.model or DEFAULT_MODEL
    args.model_path = str(resolve_model_dir(model, args.load_format or "auto"))
    args.model_name = model  # what the deployment serves (requests name it)
    if args.tokenizer is None:  # the bench counts tokens with it; a packaged dummy shape has no tokenizer
        dummy = args.load_format == "dummy" and not (Path(args.model_path) / "tokenizer.json").exists()
        args.tokenizer = str(resolve_model(DEFAULT_MODEL)) if dummy else args.model_path
    if args.load_format:
        args.up_arg += ["--serve-arg=--load-format", f"--serve-arg={args.load_format}"]
    if args.tokenizer != args.model_path:
        args.up_arg += ["--serve-arg=--tokenizer", f"--serve-arg={args.tokenizer}"]
    if args.dry_run:
        for topo_name in args.topologies.split(","):
            print(f"{topo_name}: pdserve up --topology {topo_name} --model {model} {' '.join(args.up_arg)}")
        print(f"profile: prefill {args.prefill_lens}, decode batches {args.decode_batches} x contexts "
              f"{args.decode_contexts}; bench: random {args.input_len} in / {args.output_len} out, "
              f"{args.num_prompts} prompts at {args.rates} req/s, --goodput {args.goodput}, tokenizer {args.tokenizer}; "
              f"out {args.out}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for topo_name in args.topologies.split(","):
        topo = parse_topology(topo_name)
        print(f"== {topo} (load average {profiler.load_average()})", flush=True)
        log = str(out / f"up-{str(topo).replace(':', '')}.log")
        with LaunchedTopology(str(topo), topo_name, model, log, extra_args=args.up_arg) as url:
            listing = _get(f"{url}/pdserve/instances")
            by_role = {role: [i["url"] for i in insts] for role, insts in listing.items() if insts}
            profiles = {}
            for role, urls in by_role.items():
                prof, base = profile_instance(urls[0], args, f"cpu-{role}-{topo}")
                prof.save(out / f"profile-{str(topo).replace(':', '')}-{role}.json")
                profiles[role] = (prof, base, urls[0])
            through_proxy = tiny_ttft(url)
            probe_url = profiles["prefill" if topo.disaggregated else "decode"][2]
            probe0 = probe(probe_url, args.input_len)
            if topo.disaggregated:
                p_prof, p_base, _ = profiles["prefill"]
                d_prof, _, _ = profiles["decode"]
                # the proxy hop and the handoff's fixed cost: what a tiny prompt takes through the pair beyond
                # the prefill instance alone (the READ of a tiny prompt is negligible)
                extra = max(0.0, through_proxy - p_base)
                d_prof.handoff.params_s = p_prof.handoff.params_s = extra
                pools = Pools.of(p_prof, prefill=p_prof, decode=d_prof)
            else:
                c_prof, c_base, _ = profiles["decode"]
                c_prof.overheads.ingress_s += max(0.0, through_proxy - c_base)  # the proxy's hop
                pools = Pools.of(c_prof)
            for rate in [float(r) for r in args.rates.split(",")]:
                spec = spec_for(url, args, rate)
                factor = probe(probe_url, args.input_len) / probe0
                t0 = time.time()
                measured = asyncio.run(run_serve(spec))
                load = profiler.load_average()
                jobs = bench_jobs(spec)
                run = simulate(topo, pools, jobs)
                predicted, _ = bench_result(spec, run.tracked, "sim", str(topo), print_block=False)
                run = simulate(topo, scaled(pools, factor), jobs)
                calibrated, _ = bench_result(spec, run.tracked, "sim", str(topo), print_block=False)
                row = {"topology": str(topo), "rate": rate, "load_average": load, "started": t0,
                       "handoff_fixed_ms": pools.decode.handoff.params_s * 1e3 if topo.disaggregated else None,
                       "speed_factor": factor,
                       "measured": {k: measured.get(k) for k, _ in KEYS},
                       "predicted": {k: predicted.get(k) for k, _ in KEYS},
                       "calibrated": {k: calibrated.get(k) for k, _ in KEYS}}
                rows.append(row)
                print(format_row(row), flush=True)
                with open(out / "results.json", "w", encoding="utf-8") as f:
                    json.dump(rows, f, indent=1)
    print(table(rows))
    with open(out / "table.md", "w", encoding="utf-8") as f:
        f.write(table(rows) + "\n")
    return 0


def rel(p: float | None, m: float | None) -> str:
    if p is None or m is None or not m:
        return "n/a"
    return f"{(p - m) / m * 100:+.0f} %"


def format_row(row: dict[str, Any]) -> str:
    parts = [f"{row['topology']} @ {row['rate']:g} req/s (load {row['load_average']}, speed factor "
             f"{row['speed_factor']:.2f}):"]
    for k, label in KEYS:
        m, p, c = row["measured"].get(k), row["predicted"].get(k), row["calibrated"].get(k)
        parts.append(f"{label} {fmt(m)} vs sim {fmt(p)} ({rel(p, m)}), calibrated {fmt(c)} ({rel(c, m)});")
    return " ".join(parts)


def fmt(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| topology | rate | speed | " + " | ".join(f"{label}: measured / predicted (err) / calibrated (err)"
                                                       for _, label in KEYS) + " |")
    lines = [head, "|" + "---|" * (3 + len(KEYS))]
    for r in rows:
        cells = []
        for k, _ in KEYS:
            m, p, c = r["measured"].get(k), r["predicted"].get(k), r["calibrated"].get(k)
            cells.append(f"{fmt(m)} / {fmt(p)} ({rel(p, m)}) / {fmt(c)} ({rel(c, m)})")
        lines.append(f"| {r['topology']} | {r['rate']:g} | {r['speed_factor']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
