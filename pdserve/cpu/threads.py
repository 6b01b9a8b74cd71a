"""How many torch threads a CPU step runs with: one count for decode-sized steps, one for prefill-sized.

Default (`auto`): every core but one (one on a 2-core box), as vLLM's CPU backend does (`reserve_cpu_num=1`:
its log on the 2-core box reads "core ids=[0]", "Reducing Torch threads from 2 to 1 for serving"), and
every core for a step while the rest of the machine leaves them idle: its other processes used at most
`IDLE_OTHERS_CORES` cores over the last second (`pdserve.cpu.spare_cores`: /proc/stat less this process).

Why not always every core: a step is hundreds of OpenMP regions, and each waits at a barrier for its slowest
thread; when a client or another process takes one of the engine's cores, the thread the OS descheduled
stalls every region. Measured on the shared 2-core box (load 3-5), a SmolLM2 decode step at batch 4 took
91 ms on one thread and 180-820 ms on two; under load 20-30 a 2048-token prefill took 6-13 s on two threads
where vLLM's one thread prefilled at about twice that rate. Why every core when they are idle: with
nothing else running (load 1.3-2.2), a decode step at batch 16 took ~110 ms on two threads against 160-180
ms on one: the paged attention reads each block's K/V of a layer as a separate 12 KiB chunk of the
block-contiguous pool, at ~10 GB/s against ~22 GB/s streaming, and a second core doubles the memory
parallelism (prefill's matmuls split as well). Once another process wants the core, steps go back to
one thread within about a second. Results do not depend on the thread count (the C kernels give each
sequence, prompt head or row to one thread; oneDNN's packed linears gave bit-equal outputs on 1 and 2
threads for every SmolLM2 shape), so neither do the tokens. The server's event loop (the main thread,
when the steps run in the engine thread) counts as the others: an HTTP side busy enough to want its core
keeps the steps on one thread.

Whether the second core pays for a decode step is measured, not assumed (`DecodeThreadChoice`): a decode
step is weights-bound and short, and a core that is idle by the last second's account can still be taken in
the middle of it by the server's own event loop streaming the previous step's tokens. Served at
concurrency 4 on the idle box (SmolLM2, batch-4 decode, run K in BENCHMARKS.md), steps on two threads took
49.8 ms at the median against 46.6 ms on one; offline, with nothing else running, two threads are ~1.5x
faster. So per batch-size bucket `auto` keeps a smoothed time of the decode steps on each count, runs the
faster one, and every `EXPLORE_EVERY`-th step of the bucket the other one, to follow the load.

`PDSERVE_CPU_THREADS=D[,P]` sets fixed decode and prefill counts (P defaults to D): `1` is the earlier
default on a 2-core box, `2` gives the engine both cores always.

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

from pdserve.cpu.spare_cores import SpareCores

log = logging.getLogger("pdserve.cpu")

ENV = "PDSERVE_CPU_THREADS"
BIND_ENV = "PDSERVE_CPU_BIND"
# Steps with at most this many query tokens count as decode-sized (weights-bound, short regions).
DECODE_STEP_TOKENS = 64
# `auto`: a step takes every core while the machine's other processes used at most this many cores lately
IDLE_OTHERS_CORES = 0.3
# `auto` decode steps: every this many steps of a batch-size bucket run the count the estimates do not favour
EXPLORE_EVERY = 16
# weight of the newest step in a count's smoothed step time
STEP_TIME_WEIGHT = 0.25


class DecodeThreadChoice:
    """For decode-sized steps that could take every core: smoothed wall times of the steps on the base count
    and on every core, per batch-size bucket (powers of two); `pick` runs the faster, exploring the other."""

    def __init__(self) -> None:
        self._times: dict[int, dict[int, float]] = {}  # bucket -> threads -> smoothed seconds
        self._steps: dict[int, int] = {}

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return max(1, num_tokens).bit_length()

    def pick(self, num_tokens: int, base: int, wide: int) -> int:
        b = self.bucket(num_tokens)
        times = self._times.get(b, {})
        k = self._steps[b] = self._steps.get(b, 0) + 1
        if wide not in times:
            return wide
        if base not in times:
            return base
        best, other = (base, wide) if times[base] < times[wide] else (wide, base)
        return other if k % EXPLORE_EVERY == 0 else best

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        times = self._times.setdefault(self.bucket(num_tokens), {})
        old = times.get(threads)
        times[threads] = seconds if old is None else old + STEP_TIME_WEIGHT * (seconds - old)

    def estimates(self, num_tokens: int) -> dict[int, float]:
        """threads -> smoothed step seconds, for the bucket of `num_tokens`"""
        return dict(self._times.get(self.bucket(num_tokens), {}))


class StepThreads:
    def __init__(self, decode: int, prefill: int, bind: bool = False, spare_max: int | None = None,
                 spare: SpareCores | None = None):
        """spare_max: with `spare`, the count a step takes while the other processes leave the cores idle."""
        if decode < 1 or prefill < 1:
            raise ValueError(f"{ENV}: thread counts must be >= 1, got {decode},{prefill}")
        self.decode = decode
        self.prefill = prefill
        self.bind = bind
        self.spare_max = spare_max
        self.spare = spare if spare_max is not None else None
        self.decode_choice = DecodeThreadChoice() if self.spare is not None else None
        self._bound: set[int] = set()  # idents of the threads already pinned

    @classmethod
    def from_env(cls) -> StepThreads:
        bind = os.environ.get(BIND_ENV, "0").strip() not in ("", "0")
        value = os.environ.get(ENV, "").strip()
        cores = torch.get_num_threads()  # torch's default: the cores, or OMP_NUM_THREADS
        if not value or value == "auto":
            n = max(1, cores - 1)
            if cores > n:
                spare = SpareCores()
                if spare.available:
                    return cls(n, n, bind, spare_max=cores, spare=spare)
            return cls(n, n, bind)
        try:
            parts = [int(p) for p in value.split(",")]
        except ValueError:
            raise ValueError(f"{ENV} must be D or D,P (thread counts), got {value!r}") from None
        if len(parts) not in (1, 2):
            raise ValueError(f"{ENV} must be D or D,P (thread counts), got {value!r}")
        return cls(parts[0], parts[-1], bind)

    def for_step(self, num_tokens: int) -> int:
        decode = num_tokens <= DECODE_STEP_TOKENS
        n = self.decode if decode else self.prefill
        if self.spare is not None and self.spare_max is not None and self.spare_max > n:
            others = self.spare.others_busy()
            if others is not None and others <= IDLE_OTHERS_CORES:
                if decode and self.decode_choice is not None:
                    return self.decode_choice.pick(num_tokens, n, self.spare_max)
                return self.spare_max
        return n

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A finished step's wall time (`auto` decode steps learn which count is faster from these)."""
        if self.decode_choice is not None and num_tokens <= DECODE_STEP_TOKENS:
            self.decode_choice.record(num_tokens, threads, seconds)

    def observe(self) -> None:
        """Between steps (the engine idles): keeps the spare-core window fresh, so the first step of a burst
        (a long prefill) is decided on the last second rather than on no window or one from before the lull."""
        if self.spare is not None:
            self.spare.others_busy()

    def apply(self, num_tokens: int) -> int:
        """Sets torch's thread count for a step of `num_tokens` query tokens (in the stepping thread:
        OpenMP's count is per calling thread); returns it."""
        n = self.for_step(num_tokens)
        if self.bind:
            self._pin_this_thread()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def _pin_this_thread(self) -> None:
        ident = threading.get_ident()
        if ident in self._bound or not hasattr(os, "sched_setaffinity"):
            return
        self._bound.add(ident)
        allowed = sorted(os.sched_getaffinity(0))
        cores = set(allowed[: max(self.decode, self.prefill, self.spare_max or 0)])
        os.sched_setaffinity(0, cores)  # Linux: pid 0 is the calling thread, not the whole process
        log.info("CPU steps pinned to cores %s", sorted(cores))

    def __repr__(self) -> str:
        pinned = ", pinned" if self.bind else ""
        spare = f", {self.spare_max} while the other processes leave the cores idle" if self.spare else ""
        return f"decode steps {self.decode} thread(s), prefill steps {self.prefill}{spare}{pinned}"
