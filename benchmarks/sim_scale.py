"""How fast `pdserve sim` runs the seed's fleet: 64 GPUs as 16 TP=4 instances (6 prefill + 10 decode: the seed's
3:5 node ratio), its RAG workload (28000 in / 650 out, Poisson at the seed's 24.6 req/s) for 10 simulated
minutes, on one core (run it under `taskset -c N`). TP=4 is derived from the shipped TP=1 H200 profile.

    taskset -c 0 python benchmarks/sim_scale.py [--minutes 10] [--gpus 64 | --topology 6p10d --rate 24.6]

1,000 GPUs at the same load per GPU: `--gpus 1000` (250 TP=4 instances at 3:5, 94p156d, at 384.4 req/s).
`--step-by-step`: every engine step its own event (no skipped decode stretches), for comparison.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from pdserve.launch.config import parse_topology
from pdserve.sim.profile import Profile
from pdserve.sim.run import Pools, simulate
from pdserve.sim.workload import poisson_jobs

PROFILE = os.path.join(os.path.dirname(__file__), "..", "pdserve", "data", "profiles", "h200-llama3.1-8b-fp8.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=64,
                    help="the fleet's size: TP=4 instances at the seed's 3:5 prefill:decode ratio, the seed's load "
                         "per GPU (24.6 req/s per 64 GPUs); --topology / --rate override")
    ap.add_argument("--topology", default=None)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--block-size", type=int, default=None,
                    help="simulate with this KV block size instead of the profile's (fewer blocks to allocate and "
                         "register per request: an approximation of the pool's granularity)")
    ap.add_argument("--step-by-step", action="store_true", help="no skipped decode steps (cluster.py)")
    args = ap.parse_args()
    instances = args.gpus // args.tp
    prefill = round(instances * 3 / 8)
    topo = parse_topology(args.topology or f"{prefill}p{instances - prefill}d")
    if args.rate is None:
        args.rate = round(24.6 * args.gpus / 64, 1)
    prof = Profile.load(args.profile)
    if args.block_size:
        prof.engine.block_size = args.block_size
    pools = Pools.of(prof, tp={"prefill": args.tp, "decode": args.tp})
    n = int(args.rate * args.minutes * 60)
    t0 = time.perf_counter()
    jobs = poisson_jobs(n, args.rate, 28000, 650)
    t1 = time.perf_counter()
    run = simulate(topo, pools, jobs, skip_steps=not args.step_by_step)
    done = sum(1 for t in run.tracked if t.done and not t.error)
    print(f"block size {prof.engine.block_size}: {topo} x TP={args.tp} ({pools.gpus(topo)} GPUs), {n} requests at {args.rate} req/s: simulated "
          f"{run.sim_s:.1f} s in {run.wall_s:.1f} s wall ({t1 - t0:.1f} s building the workload), "
          f"{run.deployment.events} events, {done} completed, CPU time {time.process_time():.1f} s, "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
