"""One simulated serving instance: the engine's own Scheduler and BlockManager (pdserve/engine), a model runner
that answers from the profile, and the engine's bookkeeping after a step.

What runs is the engine's policy code itself: `Scheduler.schedule()` decides every step (chunked prefill under
the token budget, admission FIFO, preemption by recompute, prefix-cache hits through `BlockManager`, the
consumer's remote-KV allocation and `end_load`); nothing here decides what runs. What this module adds is what
`LLMEngine._step` does around the model call, line for line for the plain (non-speculative) path: computed
tokens advanced and full blocks registered (`cache_full_blocks`), one token for each row at its frontier, the
stop check, and a finished request removed and its blocks freed, or held (a prefill leg's, for its consumer).
The model call is replaced by the profile's step time (`Profile.step_seconds` of the step's rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, Status
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.sim.profile import Profile, step_features

OUTPUT_TOKEN = 7  # the id every simulated row samples (none is a stop token: requests end by their length)


@dataclass
class StepResult:
    """What one simulated step did: its schedule, its duration, and the requests that got a token."""

    sched: SchedulerOutput
    seconds: float
    sampled: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class SimInstance:
    def __init__(self, name: str, role: str, profile: Profile) -> None:
        self.name = name
        self.role = role  # collocated | prefill | decode
        self.profile = profile
        e = profile.engine
        self.blocks = BlockManager(profile.num_blocks, e.block_size, e.enable_prefix_caching)
        budget = e.max_num_batched_tokens
        if not e.enable_chunked_prefill:
            budget = max(budget, profile.kv_capacity_tokens)
        self.scheduler = Scheduler(self.blocks, e.max_num_seqs, budget, e.enable_chunked_prefill,
                                   e.prefill_only_chunk_tokens)
        self.busy = False  # a step is running (the engine thread is in the model)
        self.held: dict[str, Request] = {}  # finished prefill legs whose blocks wait for their consumer's read
        self.steps = 0
        self.busy_s = 0.0
        # the output token a request samples at its n-th output position (a workload may give its own, e.g.
        # multi-turn answers that later prompts repeat); default: OUTPUT_TOKEN
        self.token_for: Callable[[Request], int] = lambda req: OUTPUT_TOKEN

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def step(self) -> StepResult | None:
        """Schedule one step; None when nothing can run (the engine idles until a request or a load end)."""
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
                if req.kv.send and req.finish_reason in ("length", "stop") and req.block_ids:
                    req.kv.hold()  # a prefill leg: its blocks wait for the consumer's read (engine/pd/holds.py)
                    self.held[req.request_id] = req
                else:
                    self.blocks.release(req)
                res.finished.append(req)

    def release_held(self, request_id: str) -> None:
        """The consumer's read of a held prefill leg ended: its blocks go back to the pool (still cached)."""
        req = self.held.pop(request_id)
        req.kv.release()
        self.blocks.release(req)
