"""Per-step timing as JSON lines, for diagnosing a server under load (`PDSERVE_STEP_LOG=FILE`).

Each line is one engine step, or (lines with a "request" key) one finished request's lifecycle. A step:
when it started, the gap since the previous step ended (time the engine thread spent elsewhere: draining
commands, idle waits, the GIL), how long scheduling, the model step and the bookkeeping after it took,
and what ran (sequences, tokens, prefill tokens, whether a CUDA graph replayed). `{role}` in the path
becomes the instance's kv_role (or "engine") and `{pid}` its process id. Off by default; when off, the
engine pays one `is None` check per step.
"""

from __future__ import annotations

import json
import os
from typing import IO

from pdserve.engine.outputs import RequestMetrics


class StepLog:
    ENV = "PDSERVE_STEP_LOG"

    def __init__(self, path: str):
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine
        self._last_end: float | None = None

    @classmethod
    def from_env(cls, role: str = "engine") -> StepLog | None:
        """`{role}` and `{pid}` in the path are replaced, so one setting serves several instances."""
        path = os.environ.get(cls.ENV)
        if not path:
            return None
        return cls(path.replace("{role}", role).replace("{pid}", str(os.getpid())))

    def record(self, start: float, scheduled: float, executed: float, end: float, *, seqs: int, tokens: int,
               prefill_tokens: int, graph: bool, wait_s: float, outputs: int) -> None:
        gap = 0.0 if self._last_end is None else start - self._last_end
        self._last_end = end
        self._file.write(json.dumps({
            "t": round(start, 6), "gap_ms": round(gap * 1e3, 3),
            "sched_ms": round((scheduled - start) * 1e3, 3), "exec_ms": round((executed - scheduled) * 1e3, 3),
            "wait_ms": round(wait_s * 1e3, 3), "post_ms": round((end - executed) * 1e3, 3),
            "seqs": seqs, "tokens": tokens, "prefill_tokens": prefill_tokens, "graph": graph, "outputs": outputs,
        }) + "\n")

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
