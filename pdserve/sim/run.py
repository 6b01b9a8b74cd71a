"""One simulated run: a topology (`pdserve up`'s names) of instances with their profiles, a workload, the
clock run until every request has ended."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.launch.config import Topology
from pdserve.sim.cluster import Deployment, Tracked
from pdserve.sim.options import SimOptions
from pdserve.sim.profile import Profile, derive_tp
from pdserve.sim.workload import Conversation, Job


@dataclass
class Pools:
    """The profile of each role's instances (TP sizes already applied)."""

    prefill: Profile
    decode: Profile
    collocated: Profile

    @classmethod
    def of(cls, base: Profile, *, prefill: Profile | None = None, decode: Profile | None = None,
           tp: dict[str, int] | None = None, tp_efficiency: float = 0.9) -> Pools:
        """`base` for every role unless one is given; a role's TP size different from its profile's is derived
        from a TP=1 profile (derive_tp: an estimate, said so in the profile's notes)."""
        tp = tp or {}
        chosen = {"prefill": prefill or base, "decode": decode or base, "collocated": base}
        for role, size in tp.items():
            prof = chosen[role]
            if size and size != prof.tp:
                chosen[role] = derive_tp(prof, size, tp_efficiency)
        return cls(**chosen)

    def gpus(self, topo: Topology) -> int:
        return (topo.num_prefill * self.prefill.tp + topo.num_decode * self.decode.tp
                + topo.num_collocated * self.collocated.tp)


def _clients_end(dep: Deployment, until: float | None = None) -> float:
    """When the last client request ended (the clock runs on after it only to end held histories' leases), or
    `until`."""
    if until is not None:
        return dep.now
    return max((t.finish_time for t in dep.tracked), default=dep.now)


@dataclass
class SimRun:
    tracked: list[Tracked]
    deployment: Deployment
    wall_s: float
    sim_s: float


def _options(options: SimOptions | None, jobs: Sequence[Job]) -> SimOptions:
    """The deployment's options for this workload: a workload without token ids (trace rows) gives the proxy no
    ids to look up, so no instance's KV events would ever be read: they are not produced."""
    opts = options or SimOptions()
    if opts.kv_events is None and jobs and all(j.token_ids is None for j in jobs):
        opts = dataclasses.replace(opts, kv_events=False)
    return opts


def deployment(topo: Topology, pools: Pools, options: SimOptions | None = None, skip_steps: bool = True,
               jobs: Sequence[Job] = ()) -> Deployment:
    return Deployment([pools.prefill] * topo.num_prefill, [pools.decode] * topo.num_decode,
                      [pools.collocated] * topo.num_collocated, skip_steps=skip_steps, options=_options(options, jobs))


def simulate(topo: Topology, pools: Pools, jobs: Sequence[Job], until: float | None = None,
             skip_steps: bool = True, options: SimOptions | None = None) -> SimRun:
    """skip_steps: decode stretches as one event each (cluster.py); False runs every step as its own event (the
    reference the skipping is tested against). `options`: push, multi-turn history, KV events (options.py)."""
    dep = deployment(topo, pools, options, skip_steps, jobs)
    for job in jobs:
        dep.submit(job)
    t0 = time.perf_counter()
    dep.run(until)
    return SimRun(dep.tracked, dep, time.perf_counter() - t0, _clients_end(dep, until))


def simulate_conversations(topo: Topology, pools: Pools, conversations: Sequence[Conversation], think_time: float,
                           max_concurrency: int | None, skip_steps: bool = True,
                           options: SimOptions | None = None) -> SimRun:
    """Conversations as bench/multiturn.py runs them: all start at once (up to `max_concurrency` side by side),
    each turn sent `think_time` after the previous answer ended."""
    dep = deployment(topo, pools, options, skip_steps)
    waiting = list(conversations)
    of: dict[int, Conversation] = {}
    counter = iter(range(1 << 62))

    def start(conv: Conversation, at: float) -> None:
        job = conv.next_job(next(counter), at)
        if job is None:
            if waiting:
                start(waiting.pop(0), at)
            return
        of[job.index] = conv
        t = dep.submit(job)
        t.conversation, t.turn = conv.index, conv.turn - 1  # type: ignore[attr-defined]

    def finished(t: Tracked, at: float) -> None:
        conv = of.pop(t.job.index)
        dep.schedule(at + think_time, lambda now: start(conv, now))

    dep.on_finish = finished
    first = waiting[: max_concurrency or len(waiting)]
    del waiting[: len(first)]
    for conv in first:
        start(conv, 0.0)
    t0 = time.perf_counter()
    dep.run()
    return SimRun(dep.tracked, dep, time.perf_counter() - t0, _clients_end(dep))
