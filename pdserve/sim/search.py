"""`pdserve sim --search`: under a GPU budget and the `--goodput` SLOs, which deployment serves the most good
requests per GPU? Candidates: collocated replicas, and every P:D split using the budget, for each TP size per
pool (`--tp-sizes`; sizes other than a profile's own are derived from its TP=1 profile: an estimate). Each is
simulated over a sweep of request rates; its score is its best goodput divided by its GPUs.

The sweep doubles the rate from 0.25 req/s until goodput falls below 90 % of the best seen (past saturation),
then tries 1.25x, 1.5x and 1.75x the best rate, unless `--request-rates` gives the rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.options import BenchSpec
from pdserve.launch.config import Topology
from pdserve.sim.options import SimOptions
from pdserve.sim.profile import Profile
from pdserve.sim.report import bench_result
from pdserve.sim.run import Pools, simulate
from pdserve.sim.workload import Job


@dataclass
class Candidate:
    topo: Topology
    tp: dict[str, int]
    gpus: int
    points: list[tuple[float, float, float, float]] = field(default_factory=list)  # rate, goodput, ttft p50, tpot

    @property
    def label(self) -> str:
        if self.topo.disaggregated:
            return f"{self.topo} (P TP={self.tp['prefill']}, D TP={self.tp['decode']})"
        return f"{self.topo} (TP={self.tp['collocated']})"

    @property
    def best_goodput(self) -> float:
        return max((g for _, g, _, _ in self.points), default=0.0)

    @property
    def per_gpu(self) -> float:
        return self.best_goodput / self.gpus if self.gpus else 0.0


def candidates(gpus: int, tp_sizes: list[int]) -> list[Candidate]:
    out: list[Candidate] = []
    for t in tp_sizes:
        if gpus // t >= 1:
            out.append(Candidate(Topology(0, 0, gpus // t), {"collocated": t}, (gpus // t) * t))
    for tp_p in tp_sizes:
        for tp_d in tp_sizes:
            for x in range(1, gpus // tp_p + 1):
                y = (gpus - x * tp_p) // tp_d
                if y >= 1:
                    out.append(Candidate(Topology(x, y, 0), {"prefill": tp_p, "decode": tp_d},
                                         x * tp_p + y * tp_d))
    return out


def at_rate(jobs: list[Job], rate: float, burstiness: float, seed: int) -> list[Job]:
    """The same requests sent at `rate` (bench/arrivals.py's draws, as `pdserve bench` at that rate)."""
    offsets = arrival_offsets(len(jobs), rate, burstiness, np.random.RandomState(seed))
    return [dataclasses.replace(j, arrival=t) for j, t in zip(jobs, offsets, strict=True)]


class Workloads:
    """The workload at each rate: at least `--num-prompts` requests, and enough for `duration` seconds of
    arrivals (a fixed count sent ever faster would end in one burst, whose goodput is the count over its
    drain time however fast the rate). Drawn once per count by `make(n)` (bench's datasets, the same seed)."""

    def __init__(self, make: Callable[[int], list[Job]], num_prompts: int, duration: float) -> None:
        self._make, self._min, self._duration = make, num_prompts, duration
        self._cache: dict[int, list[Job]] = {}

    def at(self, rate: float) -> list[Job]:
        n = max(self._min, math.ceil(rate * self._duration)) if not math.isinf(rate) else self._min
        jobs = self._cache.get(n)
        if jobs is None:
            jobs = self._cache[n] = self._make(n)
        return jobs


def evaluate(c: Candidate, pools: Pools, work: Workloads, spec: BenchSpec, rates: list[float] | None,
             options: SimOptions | None = None) -> None:
    def one(rate: float) -> float:
        run = simulate(c.topo, pools, at_rate(work.at(rate), rate, spec.burstiness, spec.seed), options=options)
        s = dataclasses.replace(spec, request_rate=rate, metric_percentiles="50")
        result, m = bench_result(s, run.tracked, "", c.label, print_block=False)
        goodput = m.request_goodput if spec.goodput else m.request_throughput
        c.points.append((rate, goodput, m.ttft.median, m.tpot.mean))
        return goodput

    if rates:
        for r in rates:
            one(r)
        return
    rate, best = 0.25, 0.0
    for _ in range(12):
        g = one(rate)
        if g < 0.9 * best:
            break
        best = max(best, g)
        rate *= 2
    # refine between the best rate and the next doubling (the peak is rarely on the grid)
    peak = max(c.points, key=lambda p: p[1])[0]
    for f in (1.25, 1.5, 1.75):
        one(peak * f)


def search_main(args: argparse.Namespace, spec: BenchSpec, base: Profile, prefill: Profile | None,
                decode: Profile | None) -> int:
    from pdserve.sim.cli import jobs_for, parse_rates

    tp_sizes = [int(t) for t in args.tp_sizes.split(",") if t.strip()]
    rates = parse_rates(args.request_rates)

    def make(n: int) -> list[Job]:
        return jobs_for(args, dataclasses.replace(spec, num_prompts=n), {base.engine.block_size})

    work = Workloads(make, spec.num_prompts, args.search_duration)
    jobs = work.at(0.0)
    if not spec.goodput:
        print("NOTE: no --goodput SLOs: ranking by request throughput")
    print(f"Searching {args.gpus} GPUs, TP sizes {tp_sizes}, >= {len(jobs)} requests per rate "
          f"(>= {args.search_duration:g} s of arrivals) "
          f"(mean {np.mean([j.prompt_len for j in jobs]):.0f} in / {np.mean([j.output_len for j in jobs]):.0f} out), "
          f"SLOs {' '.join(spec.goodput or [])}")
    cands = candidates(args.gpus, tp_sizes)
    for c in cands:
        pools = Pools.of(base, prefill=prefill, decode=decode, tp=c.tp, tp_efficiency=args.tp_efficiency)
        evaluate(c, pools, work, spec, rates, getattr(args, "sim_options", None))
        best = max(c.points, key=lambda p: p[1])
        print(f"  {c.label:<34} {c.gpus:>3} GPUs: best goodput {c.best_goodput:7.3f} req/s at {best[0]:g} req/s "
              f"({c.per_gpu:.4f} per GPU)")
    ranked = sorted(cands, key=lambda c: c.per_gpu, reverse=True)
    print(f"\n{'rank':<5} {'configuration':<34} {'GPUs':>4} {'goodput/GPU':>12} {'goodput':>9} {'at rate':>8} "
          f"{'TTFT p50':>9} {'mean TPOT':>9}")
    for i, c in enumerate(ranked[: args.top], 1):
        rate, g, ttft, tpot = max(c.points, key=lambda p: p[1])
        print(f"{i:<5} {c.label:<34} {c.gpus:>4} {c.per_gpu:>12.4f} {g:>9.3f} {rate:>8g} {ttft:>8.0f}ms "
              f"{tpot:>7.1f}ms")
    if any("DERIVED" in n for c in cands for n in Pools.of(base, tp=c.tp, tp_efficiency=args.tp_efficiency)
           .prefill.notes + Pools.of(base, tp=c.tp, tp_efficiency=args.tp_efficiency).decode.notes):
        print(f"NOTE: TP sizes other than the profile's are derived from it (x TP x {args.tp_efficiency}): estimates")
    best = ranked[0]
    if best.topo.disaggregated:
        p_gpus = best.topo.num_prefill * best.tp["prefill"]
        d_gpus = best.topo.num_decode * best.tp["decode"]
        g = math.gcd(p_gpus, d_gpus)
        print(f"Best: {best.label}: P:D GPU ratio {p_gpus // g}:{d_gpus // g} ({p_gpus}:{d_gpus})")
    else:
        print(f"Best: {best.label}")
    if args.plot:
        plot(cands, args.plot, spec)
        print(f"Plot: {args.plot}")
    return 0


def plot(cands: list[Candidate], path: str, spec: BenchSpec) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for c in sorted(cands, key=lambda c: c.per_gpu, reverse=True)[:10]:
        pts = sorted(c.points)
        ax.plot([p[0] for p in pts], [p[1] / c.gpus for p in pts], marker="o", label=c.label)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput per GPU (req/s)" if spec.goodput else "throughput per GPU (req/s)")
    ax.set_xscale("log", base=2)
    ax.set_title(f"pdserve sim --search ({' '.join(spec.goodput or [])})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
