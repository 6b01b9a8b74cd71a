"""How many torch threads a CPU step runs with: one count for decode-sized steps, one for prefill-sized.

Default: every core but one, for both (one on a 2-core box), as vLLM's CPU backend does (`reserve_cpu_num=1`:
its log on the 2-core box reads "core ids=[0]", "Reducing Torch threads from 2 to 1 for serving"). A step is
hundreds of OpenMP regions, and each waits at a barrier for its slowest thread; when the server's own HTTP
thread, a client or another process takes one of the engine's cores, the thread the OS descheduled stalls
every region. Measured on the shared 2-core box (load 3-5), a SmolLM2 decode step at batch 4 took 91 ms on one
thread and 180-820 ms on two; under load 20-30 a 2048-token prefill took 6-13 s on two threads where vLLM's
one thread prefilled at about twice that rate.

`PDSERVE_CPU_THREADS=D[,P]` sets the decode and prefill counts (P defaults to D), e.g. `2` to give the
engine both cores of an otherwise idle 2-core box.

`PDSERVE_CPU_BIND=1` also pins the stepping thread (and so the OpenMP threads it starts) to the cores it
steps on, the first max(D, P) of the ones this process may use, leaving the rest to the HTTP thread, as
vLLM's CPU worker binds itself ("core ids=[0]" on the 2-core box). Off by default (see BENCHMARKS.md,
issue 24, for what it measured).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("pdserve.cpu")

ENV = "PDSERVE_CPU_THREADS"
BIND_ENV = "PDSERVE_CPU_BIND"
# Steps with at most this many query tokens count as decode-sized (weights-bound, short regions).
DECODE_STEP_TOKENS = 64


class StepThreads:
    def __init__(self, decode: int, prefill: int, bind: bool = False):
        if decode < 1 or prefill < 1:
            raise ValueError(f"{ENV}: thread counts must be >= 1, got {decode},{prefill}")
        self.decode = decode
        self.prefill = prefill
        self.bind = bind
        self._bound: set[int] = set()  # idents of the threads already pinned

    @classmethod
    def from_env(cls) -> StepThreads:
        bind = os.environ.get(BIND_ENV, "0").strip() not in ("", "0")
        value = os.environ.get(ENV, "").strip()
        if not value:
            n = max(1, torch.get_num_threads() - 1)  # torch's default: the cores, or OMP_NUM_THREADS
            return cls(n, n, bind)
        try:
            parts = [int(p) for p in value.split(",")]
        except ValueError:
            raise ValueError(f"{ENV} must be D or D,P (thread counts), got {value!r}") from None
        if len(parts) not in (1, 2):
            raise ValueError(f"{ENV} must be D or D,P (thread counts), got {value!r}")
        return cls(parts[0], parts[-1], bind)

    def for_step(self, num_tokens: int) -> int:
        return self.decode if num_tokens <= DECODE_STEP_TOKENS else self.prefill

    def apply(self, num_tokens: int) -> None:
        """Sets torch's thread count for a step of `num_tokens` query tokens (in the stepping thread:
        OpenMP's count is per calling thread)."""
        n = self.for_step(num_tokens)
        if self.bind:
            self._pin_this_thread()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _pin_this_thread(self) -> None:
        ident = threading.get_ident()
        if ident in self._bound or not hasattr(os, "sched_setaffinity"):
            return
        self._bound.add(ident)
        allowed = sorted(os.sched_getaffinity(0))
        cores = set(allowed[: max(self.decode, self.prefill)])
        os.sched_setaffinity(0, cores)  # Linux: pid 0 is the calling thread, not the whole process
        log.info("CPU steps pinned to cores %s", sorted(cores))

    def __repr__(self) -> str:
        pinned = ", pinned" if self.bind else ""
        return f"decode steps {self.decode} thread(s), prefill steps {self.prefill}{pinned}"
