"""How many torch threads a CPU step runs with: one count for decode-sized steps, one for prefill-sized.

A decode step is bound by streaming the weights; it gains little from a second thread on a small box, and
every one of its ~300 short parallel regions waits at a barrier for the slowest thread, so when anything
else wants a core (the HTTP event loop of the same server, a benchmark client, other processes) a thread
that is descheduled stalls the whole step: measured on the shared 2-core box (load 3-5), a SmolLM2 decode
step at batch 4 took 91 ms on one thread and 180-820 ms on two. Prefill steps are compute-bound and long
per region, so they keep every core.

`PDSERVE_CPU_THREADS=D[,P]` sets the decode and prefill counts (P defaults to D); unset, decode steps use
one thread and prefill steps torch's default (`torch.get_num_threads()` at start: the cores, or
OMP_NUM_THREADS).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("pdserve.cpu")

ENV = "PDSERVE_CPU_THREADS"
# Steps with at most this many query tokens count as decode-sized (weights-bound, short regions).
DECODE_STEP_TOKENS = 64


class StepThreads:
    def __init__(self, decode: int, prefill: int):
        if decode < 1 or prefill < 1:
            raise ValueError(f"{ENV}: thread counts must be >= 1, got {decode},{prefill}")
        self.decode = decode
        self.prefill = prefill

    @classmethod
    def from_env(cls) -> StepThreads:
        value = os.environ.get(ENV, "").strip()
        if not value:
            return cls(1, torch.get_num_threads())
        try:
            parts = [int(p) for p in value.split(",")]
        except ValueError:
            raise ValueError(f"{ENV} must be D or D,P (thread counts), got {value!r}") from None
        if len(parts) not in (1, 2):
            raise ValueError(f"{ENV} must be D or D,P (thread counts), got {value!r}")
        return cls(parts[0], parts[-1])

    def for_step(self, num_tokens: int) -> int:
        return self.decode if num_tokens <= DECODE_STEP_TOKENS else self.prefill

    def apply(self, num_tokens: int) -> None:
        """Sets torch's thread count for a step of `num_tokens` query tokens (in the stepping thread:
        OpenMP's count is per calling thread)."""
        n = self.for_step(num_tokens)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def __repr__(self) -> str:
        return f"decode steps {self.decode} thread(s), prefill steps {self.prefill}"
