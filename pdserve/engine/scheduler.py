"""Continuous batching with chunked prefill under a token budget, preemption by recompute, and the
consumer side's remote-KV wait. Decides *what* runs each step; never touches tensors.

Queues: `waiting` (FIFO, preempted requests go back to its front), `loading` (consumer requests whose
blocks a NIXL read is filling: not in `running`, so never a preemption victim) and `running`. A request's
P/D state is `req.kv` (see engine/pd/kv_handoff.py); `loading` is its index of the requests whose `kv.loading`
is set, moved with that state here only (`schedule`, `end_load`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, Status

log = logging.getLogger("pdserve.engine")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens this step)
    start_loads: list[Request] = field(default_factory=list)  # blocks allocated; start the remote read
    dropped_loads: list[Request] = field(default_factory=list)  # prefix loads not worth reading: free the lease
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, prefill_only_chunk_tokens: int = 0):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A step with no decode row (no running request waits for its next token) may give its first request a
        # chunk of up to this many tokens, when that prompt has more left than the budget; the step then holds
        # that request alone. Bigger GEMMs, fewer passes over the context (a 32k prompt on the H200: 73.6 % of
        # the matmul rate in 8192-token chunks, 75.9 % in one step). 0: off.
        self.prefill_only_chunk_tokens = prefill_only_chunk_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # consumer requests whose KV a NIXL read is writing
        self.num_preemptions = 0
        self.count_external = False  # an offload tier exists: report its hits as vLLM's external prefix cache

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Admitted and not running: queued, or waiting for their KV (`loading`)."""
        return len(self.waiting) + len(self.loading)

    def remove(self, req: Request) -> None:
        """Drop a request from whichever queue holds it (blocks are the caller's business)."""
        if req in self.running:
            self.running.remove(req)
        elif req.request_id in self.loading:
            del self.loading[req.request_id]
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)

    def _fit_drafts(self, req: Request, left: int, budget: int) -> None:
        """Drafts are optional work: trimmed to the token budget, and dropped rather than take blocks the pool
        does not have free (they never preempt anyone)."""
        drafts = req.spec_token_ids[: max(0, budget - left)]
        if drafts and not self.blocks.can_allocate(req, req.num_computed_tokens + left + len(drafts)):
            drafts = []
        req.spec_token_ids = drafts

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Back to the front of the queue, to be recomputed (the prefix cache may still hold its blocks).
        Only running requests are victims: a loading one's blocks belong to its transfer."""
        self.running.remove(req)
        self.blocks.release(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.draft_computed_tokens = 0  # its blocks, the draft's KV among them, are gone
        req.status = Status.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        big = self.prefill_only_chunk_tokens > budget and self.enable_chunked_prefill and all(
            r.num_tokens - r.num_computed_tokens > 1 for r in self.running)

        def cap(left: int) -> int:
            """The most this request may take now: the budget left, or the one long chunk of a step without
            decode rows (budget then goes negative: nothing else joins the step)."""
            return self.prefill_only_chunk_tokens if big and not out.scheduled and left > budget else budget

        # 1. Running requests first: decodes and the rest of chunked prefills.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if req.spec_token_ids:
                self._fit_drafts(req, left, budget)
            left += len(req.spec_token_ids)  # drafts to verify (engine.spec_decode) run as more query tokens
            num_new = min(left, cap(left))
            if num_new <= 0:
                i += 1
                continue
            while not self.blocks.allocate(req, req.num_computed_tokens + num_new):
                victim = self.running[-1]  # lowest priority: the most recently admitted
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != Status.RUNNING:  # preempted itself
                break
            out.scheduled.append((req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            i += 1

        # 2. Admit waiting requests, FIFO, unless this step had to preempt.
        while self.waiting and not out.preempted and budget > 0:
            if len(self.running) + len(self.loading) >= self.max_num_seqs:
                break
            req = self.waiting[0]
            cached = self.blocks.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            if req.kv.needs_load and req.kv.prefix_tokens is not None:
                # A peer's held prefix: worth a read only for what the local prefix cache lacks, and only
                # from prefix_min_tokens on (the proxy's break-even, else kv_recompute_threshold: vLLM's rule);
                # else it is computed here.
                left = req.kv.prefix_tokens - len(cached) * self.blocks.block_size
                if left < max(1, req.kv.prefix_min_tokens):
                    log.info("request %s: a held prefix of %d tokens not read back: the local prefix cache has "
                             "%d of them, %d left %s; computing them here", req.request_id,
                             req.kv.prefix_tokens, len(cached) * self.blocks.block_size, left,
                             "to read" if left < 1 else f"< {req.kv.prefix_min_tokens} worth a read")
                    req.kv.drop_load()
                    out.dropped_loads.append(req)
            if req.kv.needs_load:
                # Consumer, first admission only: allocate the prompt (a prefix load: the prefix), then read
                # what the local prefix cache lacks. Once loaded, a preempted request comes back through the
                # local path.
                upto = req.kv.prefix_tokens if req.kv.prefix_tokens is not None else req.num_prompt_tokens
                if not self.blocks.allocate(req, upto, cached):
                    break
                self.waiting.popleft()
                self._note_prefix(req, len(cached))
                req.num_computed_tokens = len(cached) * self.blocks.block_size
                req.kv.begin_load()
                req.status = Status.WAITING_FOR_REMOTE_KVS
                self.loading[req.request_id] = req
                out.start_loads.append(req)
                continue
            num_computed = req.num_computed_tokens or len(cached) * self.blocks.block_size
            num_new = req.num_tokens - num_computed
            if num_new > budget:
                if not self.enable_chunked_prefill and scheduled_ids:
                    break
                num_new = min(num_new, cap(num_new))
            if not self.blocks.allocate(req, num_computed + num_new, cached):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                self._note_prefix(req, len(cached))
            req.num_computed_tokens = num_computed
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
        return out

    def _note_prefix(self, req: Request, num_cached_blocks: int) -> None:
        hit = num_cached_blocks * self.blocks.block_size
        self.blocks.record_prefix_query(req.num_prompt_tokens, hit, min(req.num_tier_hit_tokens, hit),
                                        count_external=self.count_external)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit

    def end_load(self, req: Request, ok: bool, resume: bool = True) -> None:
        """A remote read ended; its blocks are no longer the transfer's. ok: the prompt's KV (but the last
        token's, unless the first token was adopted) is in req's blocks (registered in the prefix cache, so a preemption can reuse them).
        resume: the request joins the running set (after a failure, it recomputes locally from its prefix
        cache hit); otherwise the caller finishes it and frees its blocks."""
        del self.loading[req.request_id]
        req.kv.end_load(ok)
        if ok:
            req.num_computed_tokens = req.kv.remote_tokens(req.num_prompt_tokens)
            self.blocks.cache_full_blocks(req)
        if resume:
            req.status = Status.RUNNING
            self.running.append(req)
