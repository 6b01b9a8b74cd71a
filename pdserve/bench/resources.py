"""What each target of `pdserve bench compare` is given to run on, and whether the targets are given the same.

A comparison of collocated against P/D is only fair when both get the same hardware: the same GPUs and the
same total share of their memory (on a CPU box, the same cores). On one GPU, a collocated replica limited
to 42 % of the memory against a prefill and a decode instance at 42 % each (84 % together) compares a
replica that thrashes for KV memory with one that does not: at 28k-token prompts that alone decided the
verdict (issue 36). So every launched target's resources are planned from its `pdserve up` arguments before
anything starts (the launcher's own placement, `pdserve.launch.spec.build_deployment`), printed in the report
and in the verdict, and an unequal comparison is refused unless asked for (then every verdict says so).
Targets given as URLs (servers already running) are not checked: their resources are reported as unknown.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MEMORY_FLAG = "--gpu-memory-utilization"
MEMORY_TOLERANCE = 0.01  # total memory shares within 1 % of each other count as equal (rounded arguments)


@dataclass(frozen=True)
class Resources:
    """One target's hardware: GPU ids with the memory share its instances take of each (summed over the
    instances on that GPU), or CPU cores (CPU mode); `instances` describes each instance's part."""

    gpus: dict[str, float] = field(default_factory=dict)  # GPU id -> summed memory share
    cpus: int = 0  # cores pinned to the instances (CPU mode); 0 on GPUs
    instances: tuple[str, ...] = ()

    @property
    def memory(self) -> float:
        """GPU memory in GPUs' worth: 0.84 = 84 % of one GPU."""
        return sum(self.gpus.values())

    def describe(self) -> str:
        if self.gpus:
            ids = ",".join(sorted(self.gpus))
            what = f"{len(self.gpus)} GPU{'s' if len(self.gpus) > 1 else ''} ({ids}), memory {self.memory:.2f} GPU"
        else:
            what = f"{self.cpus} CPU cores" if self.cpus else "CPU (unpinned)"
        return f"{what} [{'; '.join(self.instances)}]" if self.instances else what

    def to_dict(self) -> dict[str, object]:
        return {"gpus": dict(self.gpus), "gpu_memory": round(self.memory, 4), "cpus": self.cpus,
                "instances": list(self.instances), "text": self.describe()}


def memory_share(argv: Sequence[str], default: float) -> float:
    """The last --gpu-memory-utilization in an instance's argv (both spellings), else `default`."""
    share = default
    for i, word in enumerate(argv):
        if word == MEMORY_FLAG and i + 1 < len(argv):
            share = float(argv[i + 1])
        elif word.startswith(MEMORY_FLAG + "="):
            share = float(word.split("=", 1)[1])
    return share


def planned(topology: str, model: str, launch_args: Sequence[str]) -> Resources:
    """The resources `pdserve up --topology TOPOLOGY --model MODEL LAUNCH_ARGS` would give its instances:
    its own argument parsing and placement, without starting anything."""
    from pdserve.launch import cli as launch_cli
    from pdserve.launch import spec as launch_spec

    parser = argparse.ArgumentParser(prog="pdserve up", add_help=False)
    launch_cli.add_arguments(parser)
    args = parser.parse_args(["--topology", topology, "--model", model, *launch_args])
    cfg = launch_cli.config_from_args(args)
    cfg.log_dir = Path(tempfile.gettempdir())  # only named in the plan; nothing is written
    dep = launch_spec.build_deployment(cfg)
    gpus: dict[str, float] = {}
    cpus = 0
    parts = []
    for inst in dep.instances:
        if inst.gpu is not None:
            share = memory_share(inst.argv, launch_spec.GPU_MEMORY_UTILIZATION)
            for gpu in inst.gpu.split(","):
                gpus[gpu] = gpus.get(gpu, 0.0) + share
            parts.append(f"{inst.name}: GPU {inst.gpu} x {share:g}")
        else:
            cpus += len(inst.cpus or [])
            parts.append(f"{inst.name}: {len(inst.cpus)} cores" if inst.cpus else f"{inst.name}: CPU")
    return Resources(gpus, cpus, tuple(parts))


def inequality(resources: dict[str, Resources | None]) -> str | None:
    """Why the targets' resources differ (None: the same, or fewer than two known)."""
    known = {name: r for name, r in resources.items() if r is not None}
    if len(known) < 2:
        return None
    (first, ref), *others = known.items()
    problems = []
    for name, r in others:
        if sorted(r.gpus) != sorted(ref.gpus):
            problems.append(f"{name} runs on GPUs {','.join(sorted(r.gpus)) or 'none'}, {first} on "
                            f"{','.join(sorted(ref.gpus)) or 'none'}")
        elif abs(r.memory - ref.memory) > MEMORY_TOLERANCE * max(r.memory, ref.memory):
            problems.append(f"{name} may use {r.memory:.2f} GPU of memory, {first} {ref.memory:.2f}")
        if r.cpus != ref.cpus:
            problems.append(f"{name} is pinned to {r.cpus} CPU cores, {first} to {ref.cpus}")
    return "; ".join(problems) or None


HOW_TO_EQUALISE = (
    "give every target the same GPUs and the same total memory: leave --gpu-memory-utilization out of "
    "--launch-args (`pdserve up` splits a shared GPU's 0.9 among its instances), or set it per role, e.g. "
    "--launch-args \"--collocated-arg='--gpu-memory-utilization 0.84' --prefill-arg='--gpu-memory-utilization "
    "0.42' --decode-arg='--gpu-memory-utilization 0.42'\"; --allow-unequal-resources runs it anyway"
)
