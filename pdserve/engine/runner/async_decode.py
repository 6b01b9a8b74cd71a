"""Async scheduling of decode steps (vLLM's `--async-scheduling`): step N+1 is launched before step N's
tokens reach the host, and step N's output is handled on the host while step N+1 runs.

Why: in a decode step the next input token is this step's argmax. A synchronous engine waits for it, copies
it back, updates its requests, schedules, stages the next inputs and launches the next graph replay, and the
GPU idles through all of that host time (~0.15 ms per batch-1 step of an 8B model on the H200, 3-4 % of the
step). Here step N+1 is launched first, its input ids gathered on the device from step N's argmax buffer
(`GpuStepRunner.launch_decode`); then step N's tokens are read (a pinned copy queued behind it) and handled.

Which steps run this way: pure-decode graph steps whose tokens are the graph's greedy argmax
(`qualifies`), while the batch stays the set of running requests: nothing waiting that the scheduler would
admit now (new or preempted requests while a sequence slot is free, disk-tier reads parked, loads that
ended), no request that needs its own sampling. Everything else runs the synchronous step once the step in flight has been taken in: prefill
chunks, temperature/top-p/seeded sampling, logprobs, penalties, logit_bias, allowed_token_ids, min_tokens
not yet reached, structured output, P/D producer legs (`kv.send`), tensor parallelism (the other ranks replay
host-staged inputs), the CPU path (no device to overlap with), eager mode (no graphs).

A step launched ahead is speculative for requests that may end at step N (EOS, a stop token, a stop string
the caller finds, an abort): their row's token is dropped when the step is taken in, so nothing beyond a
stop is ever emitted. The row's K/V write lands at position p+1, past every computed token, in a block the
request owns; a block holding such a position is never in the prefix cache (only blocks of computed tokens
are), and when it goes back to the pool every later user writes it in a later step on the same stream.
Requests that certainly end at step N (max_tokens, max_model_len) get no row.

Mirrors vllm/v1/engine/core.py (step_with_batch_queue: launch the next batch, then wait for the oldest),
vllm/v1/core/sched/async_scheduler.py (a request scheduled with its output still a placeholder) and
vllm/v1/worker/gpu_model_runner.py (AsyncGPUModelRunnerOutput's pinned copy + event; the next step's input
ids taken from the previous step's sampled tokens on the device); written for pdserve's engine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.request import Request

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.runner.model_runner import ModelRunner
    from pdserve.engine.runner.step_runner import LaunchedDecode
    from pdserve.engine.scheduler import Scheduler

ASYNC_SCHEDULING_ENV = "PDSERVE_ASYNC_SCHEDULING"  # 0 / 1: overrides the default (EngineConfig.async_scheduling)


# Whether CUDA engines launch decode steps ahead unless told otherwise (the CPU path never can): on, measured
# faster on the H200 (BENCHMARKS.md, issue 21 "Third pass": P1 ITL 4.18 vs 4.41-4.49 ms, P2 8.86 vs 10.40 ms)
DEFAULT_ON_CUDA = True


def async_scheduling_enabled(setting: bool | None, device_type: str) -> bool:
    """The engine arg wins; else PDSERVE_ASYNC_SCHEDULING; else DEFAULT_ON_CUDA on CUDA, off elsewhere."""
    if setting is not None:
        return setting
    env = os.environ.get(ASYNC_SCHEDULING_ENV)
    if env is not None:
        return env != "0"
    return DEFAULT_ON_CUDA and device_type == "cuda"


@dataclass
class InflightDecode:
    """A decode step launched and not yet taken in."""

    reqs: list[Request]
    positions: list[int]  # the position each row computes: its request's num_computed_tokens when taken in
    launched: LaunchedDecode
    launched_at: float  # perf_counter


def qualifies(req: Request, pending: int) -> bool:
    """Whether the graph's argmax is exactly this request's next token while `pending` of its tokens are still
    on the device (the condition of step_runner.greedy_on_device, counted with those tokens), and nothing
    else has to see each token before the next step (structured output's matcher, a producer's hold)."""
    p = req.params
    return (p.greedy and p.logprobs is None and not p.adjusts_logits and req.grammar is None and not req.kv.send
            and len(req.output_token_ids) + pending >= p.min_tokens)


def certainly_ends(req: Request, pending: int) -> bool:
    """Whether the request ends by length once its `pending` tokens are in (Request.check_stop's length rule)."""
    return (len(req.output_token_ids) + pending >= req.max_tokens
            or req.num_tokens + pending >= req.max_model_len)


class DecodePipeline:
    """Launches decode steps ahead; the engine takes each one in (`LLMEngine._take_in`)."""

    def __init__(self, scheduler: Scheduler, blocks: BlockManager, runner: ModelRunner):
        self.scheduler = scheduler
        self.blocks = blocks
        self.runner = runner
        self.num_launched_ahead = 0  # steps launched before the previous one was taken in (tests, benchmarks)

    def launch_scheduled(self, scheduled: list[tuple[Request, int]]) -> InflightDecode | None:
        """Launch a scheduled step without waiting for it, when it is a pure decode step that qualifies;
        None: the caller runs it synchronously (nothing was launched)."""
        if not self.runner.can_launch_async or not scheduled:
            return None
        reqs: list[Request] = []
        for req, n in scheduled:
            if n != 1 or req.num_computed_tokens + 1 != req.num_tokens or not qualifies(req, 0):
                return None
            reqs.append(req)
        positions = [r.num_computed_tokens for r in reqs]
        launched = self.runner.launch_decode(reqs, positions)
        if launched is None:
            return None
        return InflightDecode(reqs, positions, launched, time.perf_counter())

    def launch_next(self, cur: InflightDecode, waiting_elsewhere: bool = False) -> InflightDecode | None:
        """The step after `cur`, launched before `cur` is taken in: the same running requests, each at its next
        position, their input ids read on the device from cur's tokens. None (nothing launched) when the next
        step must be scheduled normally: requests wait (`waiting_elsewhere`: parked disk-tier reads),
        the running set changed, a request needs host-side sampling, or a block is short (the scheduler then
        preempts as usual)."""
        s = self.scheduler
        # a waiting request the scheduler would admit now (a sequence slot free: its admission gate) must not
        # wait behind a pipeline that keeps going
        admissible = bool(s.waiting) and len(s.running) + len(s.loading) < s.max_num_seqs
        if waiting_elsewhere or admissible or not self.runner.can_launch_async:
            return None
        live = [i for i, r in enumerate(cur.reqs) if not r.finished]
        if len(live) != len(s.running) or {id(r) for r in s.running} != {id(cur.reqs[i]) for i in live}:
            return None
        rows: list[int] = []
        for i in live:
            req = cur.reqs[i]
            if certainly_ends(req, 1):
                continue
            if not qualifies(req, 1):
                return None
            rows.append(i)
        if not rows:
            return None
        reqs = [cur.reqs[i] for i in rows]
        positions = [cur.positions[i] + 1 for i in rows]
        for req, p in zip(reqs, positions, strict=True):
            # the block for position p (what the scheduler would allocate next step; a request that ends at
            # step N gives it back with the rest of its blocks)
            if not self.blocks.allocate(req, p + 1):
                return None
        launched = self.runner.launch_decode(reqs, positions, prev=cur.launched, src_rows=rows)
        if launched is None:
            return None
        self.num_launched_ahead += 1
        return InflightDecode(reqs, positions, launched, time.perf_counter())
