"""One simulated run: a topology (`pdserve up`'s names) of instances with their profiles, a workload, the
clock run until every request has ended."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.launch.config import Topology
from pdserve.sim.cluster import Deployment, Tracked
from pdserve.sim.profile import Profile, derive_tp
from pdserve.sim.workload import Job


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


@dataclass
class SimRun:
    tracked: list[Tracked]
    deployment: Deployment
    wall_s: float
    sim_s: float


def simulate(topo: Topology, pools: Pools, jobs: Sequence[Job], until: float | None = None) -> SimRun:
    dep = Deployment([pools.prefill] * topo.num_prefill, [pools.decode] * topo.num_decode,
                     [pools.collocated] * topo.num_collocated)
    for job in jobs:
        dep.submit(job)
    t0 = time.perf_counter()
    dep.run(until)
    return SimRun(dep.tracked, dep, time.perf_counter() - t0, dep.now)
