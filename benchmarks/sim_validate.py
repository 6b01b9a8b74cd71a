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
from pdserve.sim.profile import EngineSettings, refit
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
    prof = profiler.base_profile(name, str(m.info.get("model", m.model)), str(m.info.get("device", "cpu")), m.kv(),
                                 EngineSettings(block_size=int(m.info.get("block_size", 128))), 1,
                                 str(m.info.get("kv_cache_dtype", "auto")))
    prof.prefill_points, prof.decode_points = pre, dec
    prof.overheads.ingress_s = prof.overheads.egress_s = path / 2
    prof.handoff.link_bytes_per_s = profiler.copy_rate()
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
                     tokenizer=args.model_path, no_align_prompts=True)
    spec.normalise()
    return spec


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
    ap.add_argument("--up-arg", action="append", default=["--serve-arg=--cpu-kv-cache-gb 0.25"],
                    help="extra `pdserve up` arguments (default: a 0.25 GiB KV pool per instance, the box is shared)")
    args = ap.parse_args()
    from pdserve.bench.runner import run_serve
    from pdserve.model.default_model import DEFAULT_MODEL, resolve_model

    model = args.model or DEFAULT_MODEL
    args.model_path = str(resolve_model(model))
    args.model_name = model  # what the deployment serves (requests name it); the tokenizer is the folder
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
