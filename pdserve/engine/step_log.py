"""Per-step timing as JSON lines, for diagnosing a server under load (`PDSERVE_STEP_LOG=FILE`).

Each line is one engine step, or (lines with a "request" key) one finished request's lifecycle. A step:
when it started, the gap since the previous step ended (time the engine thread spent elsewhere: draining
commands, idle waits, the GIL), how long scheduling, the model step and the bookkeeping after it took,
and what ran (sequences, tokens, prefill tokens, whether a CUDA graph replayed). `{role}` in the path
becomes the instance's kv_role (or "engine") and `{pid}` its process id. Off by default; when off, the
engine pays one `is None` check per step.

On Linux each step also says where the stepping thread's wall time went, from the kernel's per-thread
scheduler counters (/proc/thread-self/schedstat: time on a CPU, time runnable but waiting for one):
`run_ms` on a CPU, `rq_ms` waiting on the run queue (other threads and processes had the cores), and
`blocked_ms` = the rest, asleep (the GIL, a lock, a condition variable), for the step and (`gap_*`) for the
time since the previous step. `other_run_ms` is the CPU time the process's other threads (the HTTP
server's event loop, tokenization, ...) used meanwhile. These hold under load, where wall times do not.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO

from pdserve.types.outputs import RequestMetrics


class ThreadClock:
    """The kernel's scheduler counters of the calling thread (Linux): nanoseconds on a CPU and nanoseconds
    runnable but waiting for one; of the process's other threads, their summed time on a CPU."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()
        self._own = Path(f"/proc/self/task/{self.tid}/schedstat")
        self.available = self._own.exists()

    def own(self) -> tuple[int, int]:
        """(run ns, run-queue wait ns) of the thread that built this clock, which must be the caller; (0, 0)
        off Linux. The run time is the thread's CPU clock (exact at the call; schedstat's copy lags by up to
        a scheduler tick); the wait is exact whenever the caller reads it, since a wait is added when it
        ends and the caller is running."""
        if not self.available:
            return 0, 0
        try:
            wait = int(self._own.read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return 0, 0
        return time.thread_time_ns(), wait

    def others_run(self) -> int:
        """Summed run ns of the process's other threads (threads that exited meanwhile drop out: a rough
        count across thread churn, exact for long-lived threads such as the event loop)."""
        if not self.available:
            return 0
        total = 0
        for task in Path("/proc/self/task").iterdir():
            if task.name == str(self.tid):
                continue
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
        return total


class StepLog:
    ENV = "PDSERVE_STEP_LOG"

    def __init__(self, path: str):
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine
        self._last_end: float | None = None
        self._clock: ThreadClock | None = None  # built by the first step's thread: the stepping thread
        self._last_counters: tuple[int, int, int] | None = None  # (run, rq wait, others' run) at the last end

    @classmethod
    def from_env(cls, role: str = "engine") -> StepLog | None:
        """`{role}` and `{pid}` in the path are replaced, so one setting serves several instances."""
        path = os.environ.get(cls.ENV)
        if not path:
            return None
        return cls(path.replace("{role}", role).replace("{pid}", str(os.getpid())))

    def counters(self) -> tuple[int, int, int]:
        """The stepping thread's (run ns, run-queue wait ns) and the other threads' run ns, now; the engine
        reads them when a step starts and passes them to `record`."""
        if self._clock is None or self._clock.tid != threading.get_native_id():
            self._clock = ThreadClock()  # the first step, or the stepping thread changed
            self._last_counters = None
        run, wait = self._clock.own()
        return run, wait, self._clock.others_run()

    def record(self, start: float, scheduled: float, executed: float, end: float, *, seqs: int, tokens: int,
               prefill_tokens: int, graph: bool, wait_s: float, outputs: int,
               start_counters: tuple[int, int, int] | None = None, threads: int | None = None) -> None:
        end_counters = None
        if start_counters is not None and self._clock is not None and self._clock.available:
            # read before the step's end time is taken, so that the wall window [start, end] encloses the
            # counters' window: a preemption between the two would otherwise charge run-queue wait to the
            # counters that the wall clock did not see (caught under load: run + wait > wall)
            end_counters = self.counters()
            end = time.perf_counter()
        gap = 0.0 if self._last_end is None else start - self._last_end
        self._last_end = end
        line = {
            "t": round(start, 6), "gap_ms": round(gap * 1e3, 3),
            "sched_ms": round((scheduled - start) * 1e3, 3), "exec_ms": round((executed - scheduled) * 1e3, 3),
            "wait_ms": round(wait_s * 1e3, 3), "post_ms": round((end - executed) * 1e3, 3),
            "seqs": seqs, "tokens": tokens, "prefill_tokens": prefill_tokens, "graph": graph, "outputs": outputs,
        }
        if threads is not None:
            line["threads"] = threads  # CPU: the torch threads the step ran on
        if start_counters is not None and end_counters is not None:
            line.update(_split("", end - start, start_counters, end_counters))
            if self._last_counters is not None:
                line.update(_split("gap_", gap, self._last_counters, start_counters))
            self._last_counters = end_counters
        self._file.write(json.dumps(line) + "\n")

    def record_request(self, request_id: str, metrics: RequestMetrics, *, prompt_tokens: int, cached_tokens: int,
                       output_tokens: int, finish_reason: str | None) -> None:
        """One line per finished request: its lifecycle times on the same clock as the steps."""
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - metrics.arrival_time) * 1e3, 3)

        self._file.write(json.dumps({
            "request": request_id, "t": round(metrics.arrival_time, 6),
            "load_start_ms": ms(metrics.kv_load_start_time), "load_done_ms": ms(metrics.kv_load_done_time),
            "scheduled_ms": ms(metrics.first_scheduled_time), "first_token_ms": ms(metrics.first_token_time),
            "finished_ms": ms(metrics.finished_time), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens, "output_tokens": output_tokens, "finish_reason": finish_reason,
        }) + "\n")

    def close(self) -> None:
        self._file.close()


def _split(prefix: str, wall_s: float, before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    """An interval's wall time split into on-CPU, run-queue wait and blocked (the rest), in ms."""
    run = (after[0] - before[0]) / 1e6
    rq = (after[1] - before[1]) / 1e6
    return {f"{prefix}run_ms": round(run, 3), f"{prefix}rq_ms": round(rq, 3),
            f"{prefix}blocked_ms": round(max(wall_s * 1e3 - run - rq, 0.0), 3),
            f"{prefix}other_run_ms": round((after[2] - before[2]) / 1e6, 3)}
