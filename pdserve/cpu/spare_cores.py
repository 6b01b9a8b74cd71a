"""How much CPU the rest of the machine has been using lately: the machine's busy time (/proc/stat) minus
this process's own stepping (its threads but the main one, when the steps run elsewhere: a server's event
loop counts as the others'), over a short sliding window, in cores.

The CPU step threads use it to take every core only while the others leave them idle (`StepThreads`,
`PDSERVE_CPU_THREADS=auto`): an OpenMP region waits at its barrier for its slowest thread, so a second
thread on a core that another process wants stalls every region of the step, while on an idle core it
halves a prefill step's matmuls and doubles the memory parallelism of the decode attention.

Linux only (/proc/stat); elsewhere `others_busy()` is None and callers keep their fixed counts.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

_STAT = Path("/proc/stat")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float | None:
    """Seconds all CPUs spent busy since boot (user, nice, system, irq, softirq; not idle, iowait or steal)."""
    try:
        with _STAT.open() as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / _TICK


def _own_busy_s() -> float:
    t = os.times()
    return t.user + t.system


def _main_thread_busy_s() -> float:
    """CPU seconds of this process's main thread (the server's event loop: HTTP, tokenization), 0 if unknown."""
    try:
        fields = Path(f"/proc/self/task/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _step_counters() -> tuple[float | None, float]:
    """(machine busy s, this process's busy s); called from a stepping thread other than the main thread,
    the main thread's CPU counts as the others': an event loop busy with HTTP wants its core as much as
    another process does."""
    own = _own_busy_s()
    if threading.current_thread() is not threading.main_thread():
        own -= _main_thread_busy_s()
    return _machine_busy_s(), own


class SpareCores:
    """`others_busy()`: cores the machine's other processes kept busy over the last `window_s` seconds,
    re-sampled at most every `sample_s` (a /proc/stat read, ~20 us)."""

    def __init__(self, window_s: float = 1.0, sample_s: float = 0.1,
                 counters: Callable[[], tuple[float | None, float]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """counters: () -> (machine busy s or None, own busy s); the real ones by default."""
        self.window_s = window_s
        self.sample_s = sample_s
        self._counters = counters or _step_counters
        self._clock = clock
        self._samples: deque[tuple[float, float, float]] = deque()  # (clock, machine busy, own busy)
        self.available = self._counters()[0] is not None

    def others_busy(self) -> float | None:
        if not self.available:
            return None
        now = self._clock()
        if not self._samples or now - self._samples[-1][0] >= self.sample_s:
            machine, own = self._counters()
            if machine is None:
                return None
            self._samples.append((now, machine, own))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
                self._samples.popleft()
            if now - self._samples[0][0] > 2 * self.window_s:  # after an idle spell: only fresh samples count
                self._samples = deque([self._samples[-1]])
        if len(self._samples) < 2:
            return None  # no window yet
        t0, m0, o0 = self._samples[0]
        t1, m1, o1 = self._samples[-1]
        if t1 - t0 < self.sample_s:
            return None
        return max(0.0, (m1 - m0) - (o1 - o0)) / (t1 - t0)
