"""One simulated serving instance: the engine's own Scheduler and BlockManager (pdserve/engine), a model runner
that answers from the profile, and the engine's bookkeeping after a step.

What runs is the engine's policy code itself: `Scheduler.schedule()` decides every step (chunked prefill under
the token budget, admission FIFO, preemption by recompute, prefix-cache hits through `BlockManager`, the
consumer's remote-KV allocation and `end_load`); nothing here decides what runs. What this module adds is what
`LLMEngine._step` does around the model call, line for line for the plain (non-speculative) path: computed
tokens advanced and full blocks registered (`cache_full_blocks`), one token for each row at its frontier, the
stop check, and a finished request removed and its blocks freed, or held (a prefill leg's, for its consumer).
The model call is replaced by the profile's step time (`Profile.step_seconds` of the step's rows).

Step skipping (`plan_run` / `advance`): a decode-only stretch, where the scheduler would schedule the same rows one
token each step until one of them ends (none waiting, none preempted: the pool has the blocks the stretch needs),
is planned at its first step and applied lazily: the cluster keeps one event for the stretch's last step, and
applies the steps before an outside event touches the instance (`Deployment._sync`). `advance` replays what the
skipped `schedule()` + `commit()` calls would have done to the pool, in their order: each block the real
`BlockManager.allocate` would take at a step's start, each block `cache_full_blocks` would register at its end
(the same calls, only at the steps where they do something), the tokens and the computed counts. Its equality
with the step-by-step run is tests/test_sim.py's `test_step_skipping_equals_step_by_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from operator import add

import numpy as np

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.pd.admission import Admission
from pdserve.engine.pd.holds import Holds
from pdserve.engine.request import Request, Status
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.sim.profile import Profile, step_features
from pdserve.sim.seams import SimConnector, SimConsumer, SimProducer

MAX_MODEL_LEN = 1 << 30  # requests end by their length; the profile's pool bounds what fits
VOCAB_SIZE = 1 << 31  # the simulated ids are any ints (no first token is out of vocabulary)
MAX_RUN_STEPS = 4096  # the longest stretch planned at once (its step times are computed when it is planned)
OUTPUT_TOKEN = 7  # the id every simulated row samples (none is a stop token: requests end by their length)


@dataclass
class StepResult:
    """What one simulated step did: its schedule, its duration, and the requests that got a token."""

    sched: SchedulerOutput
    seconds: float
    sampled: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


@dataclass(eq=False)
class DecodeRun:
    """A planned stretch of `len(ends)` decode steps (step j is `ends[j - 1]`'s): every row one token a step, in
    the scheduler's running order, the last step the first at which a row ends (or the last the pool has blocks
    for). Steps before `committed` + 1 are applied; step 1's schedule ran for real."""

    rows: list[Request]
    tokens: list[int]  # the token each row samples
    start: list[int]  # each row's num_computed_tokens before step 1
    # numpy arrays (float64: the same IEEE values as the step events' Python floats), read by the slices used: a
    # stretch is planned up to MAX_RUN_STEPS ahead and usually cut after tens of steps by an outside event
    seconds: np.ndarray  # step j's duration at index j - 1
    ends: np.ndarray
    by_phase: dict[int, list[int]]  # start % block_size -> row indexes (running order): who crosses a block when
    committed: int = 0  # steps whose end (commit) is applied
    allocated: int = 1  # steps whose start (schedule: block allocation) is applied

    def result(self, step: int) -> StepResult:
        """Step `step` as the StepResult the engine's schedule() would have returned."""
        return StepResult(SchedulerOutput(scheduled=[(r, 1) for r in self.rows]), float(self.seconds[step - 1]))

    def end(self, step: int) -> float:
        """When step `step` ends (1-based)."""
        return float(self.ends[step - 1])


class SimInstance:
    def __init__(self, name: str, role: str, profile: Profile, *, connector: SimConnector | None = None,
                 events: bool = False) -> None:
        self.name = name
        self.role = role  # collocated | prefill | decode
        self.profile = profile
        e = profile.engine
        # events: the pool queues vLLM's KV events (BlockStored / BlockRemoved) for the proxy's index
        self.blocks = BlockManager(profile.num_blocks, e.block_size, e.enable_prefix_caching, enable_events=events)
        budget = e.max_num_batched_tokens
        if not e.enable_chunked_prefill:
            budget = max(budget, profile.kv_capacity_tokens)
        self.scheduler = Scheduler(self.blocks, e.max_num_seqs, budget, e.enable_chunked_prefill,
                                   e.prefill_only_chunk_tokens)
        if connector is None:  # an instance alone (tests): leases at time 0, nothing declined
            connector = SimConnector(SimProducer(name, lambda: 0.0, ttl_s=480.0, block_bytes=0),
                                     SimConsumer(lambda params: None))
        self.connector = connector
        # the engine's own: finished legs' blocks held for a consumer or as a conversation (pdserve/engine/pd)
        self.holds = Holds(connector, self.blocks, frozenset(), MAX_MODEL_LEN)
        # a prefill leg reading a held prefix back: its params matched against the prompt as the engine does
        self.admission = Admission(connector, self.blocks, VOCAB_SIZE, frozenset())
        self.busy = False  # a step is running (the engine thread is in the model)
        self.steps = 0
        self.busy_s = 0.0
        self.order = 0  # its place among the deployment's instances (the order of simultaneous step ends)
        self.run: DecodeRun | None = None  # a decode stretch under way whose steps are skipped (cluster.py)
        # the output token a request samples at its n-th output position (a workload may give its own, e.g.
        # multi-turn answers that later prompts repeat); default: OUTPUT_TOKEN
        self.token_for: Callable[[Request], int] = lambda req: OUTPUT_TOKEN

    @property
    def held(self) -> dict[str, Request]:
        """Finished prefill legs whose blocks wait for their consumer's read (Holds.held)."""
        return self.holds.held

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def step(self) -> StepResult | None:
        """Schedule one step; None when nothing can run (the engine idles until a request or a load end)."""
        if self.holds.history:  # LLMEngine._step: held conversations give way before the step would wait
            self.holds.make_room(self.scheduler.running, self.scheduler.waiting)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return None if not sched.start_loads else StepResult(sched, 0.0)
        seconds = self.profile.step_seconds(step_features((n, r.num_computed_tokens) for r, n in sched.scheduled))
        self.steps += 1
        self.busy_s += seconds
        return StepResult(sched, seconds)

    def commit(self, res: StepResult) -> None:
        """After the model ran (LLMEngine._step's non-speculative path): tokens computed, blocks registered,
        one token per row at its frontier, stop checks, finished requests out."""
        for req, n in res.sched.scheduled:
            req.num_computed_tokens += n
            self.blocks.cache_full_blocks(req)
        for req, _ in res.sched.scheduled:
            if req.num_computed_tokens != req.num_tokens or req.status is not Status.RUNNING:
                continue  # mid-way through a chunked prefill: samples nothing
            tok = self.token_for(req)
            req.output_token_ids.append(tok)
            res.sampled.append(req)
            if req.check_stop(tok):
                self.scheduler.remove(req)
                req.status = Status.FINISHED
                # held for the consumer's read (a prefill leg), kept as a conversation (a decode leg with
                # bidirectional_kv_xfer), or freed: LLMEngine._finish -> EnginePD.on_finished
                if not self.holds.finished(req, completed=True):
                    self.blocks.release(req)
                res.finished.append(req)

    # ---- step skipping -------------------------------------------------------------------------
    def plan_run(self, res: StepResult, now: float, min_steps: int = 2) -> DecodeRun | None:
        """`res` (just scheduled at `now`) as the first step of a decode stretch, or None when the next steps may
        differ from it: rows other than the running set, a prefill chunk, drafts, a waiting request that may be
        admitted, a preemption or a load this step, a row whose sampled token could stop it (stop tokens are checked per
        token: not skipped), or fewer than `min_steps` steps before a row ends."""
        sched, sch, blocks = res.sched, self.scheduler, self.blocks
        rows = sch.running
        # a waiting request is admitted at no step of the stretch when the running and loading sets are full (they
        # stay so: no row ends before the last step, a load ends only by an outside event, which cuts the stretch)
        admits = bool(sch.waiting) and len(rows) + len(sch.loading) < sch.max_num_seqs
        if (sched.preempted or sched.start_loads or sched.dropped_loads or admits or not rows
                or len(sched.scheduled) != len(rows)):
            return None
        tokens: list[int] = []
        last = 1 << 62
        for (req, n), row in zip(sched.scheduled, rows, strict=True):
            if (req is not row or n != 1 or req.spec_token_ids or req.grammar is not None
                    or req.num_computed_tokens + 1 != req.num_tokens):
                return None
            tok = self.token_for(req)
            p = req.params
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_token_ids):
                return None
            # check_stop after step j: len(output) + j >= max_tokens or num_tokens + j >= max_model_len
            last = min(last, req.max_tokens - len(req.output_token_ids), req.max_model_len - req.num_tokens)
            tokens.append(tok)
        last = max(1, min(last, MAX_RUN_STEPS))
        start = [r.num_computed_tokens for r in rows]
        # no preemption: the blocks the stretch's allocations take must be free now (nothing frees one in it)
        free, held = blocks.num_free_blocks, [len(r.block_ids) for r in rows]

        def new_blocks(k: int) -> int:
            return sum(max(0, blocks.blocks_needed(c + k) - h) for c, h in zip(start, held, strict=True))

        if self.holds.history:
            # make_room runs before every step: the stretch may skip it only where it frees nothing, i.e. the pool
            # keeps, at every step, what the rows need for their next tokens (at most 2 blocks each) and the next
            # waiting prompt's blocks
            keep = 2 * len(rows) + (blocks.blocks_needed(sch.waiting[0].num_tokens + 1) if sch.waiting else 0)
            free -= keep
            if free < 0:
                return None
        if new_blocks(last) > free:
            lo, hi = 1, last  # new_blocks(1) == 0: step 1 is allocated
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if new_blocks(mid) <= free else (lo, mid - 1)
            last = lo
        if last < min_steps:
            return None
        # the step model's features of step j: n decode rows, context sum(start) + n * j (step_features' sums of
        # integers, exact in floats)
        n, ctx = len(rows), sum(start)
        secs = self.profile.decode_steps_seconds(n, np.arange(ctx + n, ctx + n * last + 1, n, dtype=np.int64))
        if secs[0] != res.seconds:
            return None  # not the features step_features gave step 1: do not guess
        # now + s1, then + s2, ...: the step events' sums (numpy's cumsum adds in order, one at a time)
        ends = np.cumsum(np.concatenate(([now], secs)))[1:]
        seconds = secs
        by_phase: dict[int, list[int]] = {}
        bs = blocks.block_size
        for i, c in enumerate(start):
            by_phase.setdefault(c % bs, []).append(i)
        return DecodeRun(list(rows), tokens, start, seconds, ends, by_phase)

    def advance(self, run: DecodeRun, commits: int, allocs: int) -> None:
        """Applies `run`'s steps up to the end of step `commits` and the start of step `allocs` (>= commits), in
        the engine's order: step j's allocations, then step j's commit, then step j + 1's allocations. Only the
        steps where a row crosses a block are visited: a row whose computed count is a block boundary takes its
        next block at a step's start (`allocate`), a row that fills a block registers it at its end
        (`cache_full_blocks`), every row at step 1's end (commit() calls it every step: a prefix hit may be
        unregistered); at the other steps those calls change nothing."""
        rows, start, blocks = run.rows, run.start, self.blocks
        bs = blocks.block_size
        lo_alloc, lo_commit = run.allocated + 1, run.committed + 1
        todo: list[tuple[int, int, int]] = []  # (step, 0 allocation / 1 commit, phase)
        for p in run.by_phase:
            first = lo_alloc + (1 - p - lo_alloc) % bs  # j = 1 - p (mod bs): start + j - 1 is a boundary
            todo.extend((j, 0, p) for j in range(first, allocs + 1, bs))
            lo = max(lo_commit, 2)
            first = lo + (-p - lo) % bs  # j = -p (mod bs): start + j fills a block
            todo.extend((j, 1, p) for j in range(first, commits + 1, bs))
        if lo_commit == 1 and commits >= 1:
            todo.append((1, 1, -1))
        todo.sort()
        if commits > run.committed:
            for req, tok in zip(rows, run.tokens, strict=True):
                req.output_token_ids.extend([tok] * (commits - run.committed))
        for j, kind, p in todo:
            if kind == 0:
                for i in run.by_phase[p]:
                    if not blocks.allocate(rows[i], start[i] + j):
                        raise AssertionError("a planned decode step found the pool short")
            else:
                for i in run.by_phase[p] if p >= 0 else range(len(rows)):
                    rows[i].num_computed_tokens = start[i] + j
                    blocks.cache_full_blocks(rows[i])
        if allocs > run.allocated:
            self.steps += allocs - run.allocated
            self.busy_s = reduce(add, run.seconds[run.allocated:allocs].tolist(), self.busy_s)  # step by step's sums
            run.allocated = allocs
        if commits > run.committed:
            for req, c in zip(rows, start, strict=True):
                req.num_computed_tokens = c + commits
            run.committed = commits

    def release_held(self, request_id: str) -> None:
        """The consumer's read of a held prefill leg ended: its blocks go back to the pool (still cached)."""
        self.holds.released([request_id])
