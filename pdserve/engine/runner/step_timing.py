"""Host-side counters of the CUDA step path (GpuStepRunner); all zero where it does not run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTiming:
    """Accumulated host-side timing, to report the CPU's share of a step."""

    steps: int = 0
    graph_steps: int = 0
    total_s: float = 0.0  # inside execute()
    wait_s: float = 0.0  # blocked on the device result (the device busy, the host idle)
    launch_s: float = 0.0  # in graph.replay() (host side of the launch)

    def reset(self) -> None:
        self.steps = self.graph_steps = 0
        self.total_s = self.wait_s = self.launch_s = 0.0
