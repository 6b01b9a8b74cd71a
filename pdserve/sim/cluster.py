"""The discrete-event simulation of a deployment: simulated instances (instance.py) behind the proxy's own
instance choice, on a simulated clock.

The event loop is a heap of (time, class, tiebreak, sequence, callback): the engine is a step loop (schedule, run
the model, take the tokens in), so each instance is one chain of step events, and the other events are arrivals, a
prefill's params reaching its decode leg, a lease claim and a READ's end (link.py). At one instant, step ends come
first (class 0, in instance order), then the other events in the order they were scheduled (class 1): a fixed rule
for coincidences, which lets a decode stretch whose steps are skipped (instance.py's `DecodeRun`) be applied up to
an outside event's time exactly as the step events would have been (`_sync`). A plain heap keeps the hot
path a tuple push and pop per step; a process library (SimPy) would add a generator resume per event and its
resources do not model a link's bandwidth shared by the transfers in flight, which must be recomputed on every
start and end anyway.

The proxy's choice is the proxy's code: `PairChooser` (pdserve/proxy/pairing.py) over `Pool`s of
`Instance`s (pdserve/proxy/pool.py, whose choice is pdserve/routing/choice.py's `LoadBalancer`), with the legs'
load accounting (`acquire` / `release`: legs in flight and outstanding tokens) done where the proxy does it.
Its coroutines are driven to completion synchronously: with healthy instances they never wait.

The paths, as the real system takes them:
- collocated (`collocated:N`): the decode pool's least-loaded instance computes the prompt and decodes; tokens
  reach the client `overheads.egress_s` after the step that sampled them.
- P/D (`XpYd`, pull, early decode leg: pdserve's defaults): the decode instance is chosen first
  (`PairChooser.early_decode`), its leg waits there for the prefill's params (not scheduled); the prefill
  instance (`PairChooser.prefill`) computes the prompt with max_tokens 1 and holds its blocks; its params reach
  the decode leg `handoff.params_s` later (the request is then scheduled there: `Scheduler.schedule` allocates
  its blocks and starts the load); the lease is claimed `handoff.claim_s` after the load starts, and the adopted
  first token goes out at the decode engine's next step boundary (the engine polls claims between steps); the
  READ (the prompt's KV bytes) runs on the links, contended; when it ends the producer's blocks are freed and
  the request joins the running set at the consumer's next step (`Scheduler.end_load`).
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from bisect import bisect_right
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.pd import FirstToken
from pdserve.engine.pd.kv_handoff import KVHandoff, KVState
from pdserve.engine.request import Request
from pdserve.sim.instance import OUTPUT_TOKEN, DecodeRun, SimInstance, StepResult
from pdserve.sim.link import Links
from pdserve.sim.profile import Profile
from pdserve.sim.workload import Job
from pdserve.types.sampling_params import SamplingParams

MAX_MODEL_LEN = 1 << 30  # requests end by their length; the profile's pool bounds what fits


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs a coroutine that never suspends (the proxy's choice among healthy instances) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the proxy's choice waited for an instance: the simulation has none to wait for")


@dataclass(eq=False)
class Tracked:
    """One client request: its job, the legs serving it, and when each token reached the client."""

    job: Job
    token_times: array[float] = field(default_factory=lambda: array("d"))  # 8 bytes a token, not a float object
    cached_tokens: int = 0
    error: str = ""
    done: bool = False
    finish_time: float = 0.0
    decode_inst: Any = None  # proxy Instance of the leg that streams (for release)
    prefill_inst: Any = None


class Deployment:
    """Instances, the proxy's pools over them, the links, and the event loop."""

    def __init__(self, prefill: list[Profile], decode: list[Profile], collocated: list[Profile],
                 *, seed_rotation: int = 0, skip_steps: bool = True) -> None:
        from pdserve.proxy.config import ProxyConfig
        from pdserve.proxy.metrics import ProxyMetrics
        from pdserve.proxy.pairing import PairChooser
        from pdserve.proxy.pool import Pool
        from pdserve.proxy.readiness import Readiness

        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, Callable[[float], None]]] = []
        self.skip_steps = skip_steps  # decode stretches as one event each (DecodeRun); False: every step
        self._seq = itertools.count()
        self.instances: dict[str, SimInstance] = {}
        self.disaggregated = bool(prefill)
        self._p_pool = Pool("prefill")
        self._d_pool = Pool("decode")
        self._proxy_inst: dict[str, Any] = {}
        port = itertools.count(10000)
        for role, profiles, pool in (("prefill", prefill, self._p_pool), ("decode", decode, self._d_pool),
                                     ("collocated", collocated, self._d_pool)):
            for i, prof in enumerate(profiles):
                name = f"{role}-{i}"
                inst = SimInstance(name, role, prof)
                inst.order = len(self.instances)
                self.instances[name] = inst
                pinst = pool.add(f"http://sim-{name}:{next(port)}", healthy=True)
                pinst.params_later = role == "decode"  # pdserve decode instances take the early leg
                self._proxy_inst[name] = pinst
                pinst.sim_name = name  # type: ignore[attr-defined]
        self.config = ProxyConfig()
        self.metrics = ProxyMetrics(lambda: [self._p_pool, self._d_pool])
        self.chooser = PairChooser(self.config, self._p_pool, self._d_pool, self.metrics, Readiness(),
                                   lambda: None, None)
        self.links = Links(lambda name: self.instances[name].profile.handoff.link_bytes_per_s, self.schedule)
        self.tracked: list[Tracked] = []
        self._pending: dict[str, list[Callable[[float], None]]] = {n: [] for n in self.instances}
        self._legs: dict[str, Tracked] = {}  # request id of a leg -> its client request
        self.events = 0
        self.on_finish: Callable[[Tracked, float], None] | None = None  # the workload's (multi-turn next turn)

    # ---- the clock ----------------------------------------------------------------------------
    def schedule(self, at: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (at, 1, 0, next(self._seq), fn))

    def _schedule_step_end(self, inst: SimInstance, at: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (at, 0, inst.order, next(self._seq), fn))

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            at = entry[0]
            if until is not None and at > until:
                heapq.heappush(heap, entry)
                for inst in self.instances.values():  # the state at `until`, as the step events give it
                    self._sync(inst, until)
                break
            self.now = at
            self.events += 1
            entry[4](at)

    # ---- clients ------------------------------------------------------------------------------
    def submit(self, job: Job) -> Tracked:
        t = Tracked(job)
        self.tracked.append(t)
        self.schedule(job.arrival, lambda now: self._arrive(t, now))
        return t

    def _arrive(self, t: Tracked, now: float) -> None:
        job = t.job
        tokens = job.prompt_len
        decode_tokens = tokens + job.output_len
        if not self.disaggregated:
            pinst = run_now(self.chooser.decode(wait=True, computes_prompt=True))
            pinst.acquire(decode_tokens)
            t.decode_inst = pinst
            inst = self.instances[pinst.sim_name]
            req = self._request(f"{job.index}", job, inst, max_tokens=job.output_len, kv=KVHandoff())
            self._legs[req.request_id] = t
            job.forget_hashes()
            self._admit(inst, req, now + inst.profile.overheads.ingress_s, t, streams=True)
            return
        # the proxy's order (proxy/plan.py decide_pair): the prefill instance first, then the early decode leg's
        # instance, one that pairs with it (the decode leg's choice when no early leg is possible is made here too,
        # not after the prefill answered: a simplification)
        p_pinst = run_now(self.chooser.prefill(wait=True))
        p_pinst.acquire(tokens)
        d_pinst = run_now(self.chooser.early_decode({"n": 1}, p_pinst))
        if d_pinst is None:
            d_pinst = run_now(self.chooser.decode(wait=True, pair_with=p_pinst))
        d_pinst.acquire(decode_tokens)
        t.decode_inst, t.prefill_inst = d_pinst, p_pinst
        p = self.instances[p_pinst.sim_name]
        d = self.instances[d_pinst.sim_name]
        p_req = self._request(f"{job.index}-p", job, p, max_tokens=1, kv=KVHandoff(send=True))
        d_req = self._request(f"{job.index}-d", job, d, max_tokens=job.output_len,
                              kv=KVHandoff(state=KVState.WAITING))
        self._legs[p_req.request_id] = t
        self._legs[d_req.request_id] = t
        p_req.sim_pair = (d, d_req)  # type: ignore[attr-defined]
        job.forget_hashes()
        self._admit(p, p_req, now + p.profile.overheads.ingress_s, t, streams=False)

    def _request(self, rid: str, job: Job, inst: SimInstance, max_tokens: int, kv: KVHandoff) -> Request:
        req = Request(rid, job.prompt_ids(), SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(),
                      MAX_MODEL_LEN, kv, arrival_time=job.arrival)
        req.block_hashes = list(job.block_hashes(inst.blocks.block_size))
        return req

    def _admit(self, inst: SimInstance, req: Request, at: float, t: Tracked, streams: bool) -> None:
        def add(now: float) -> None:
            if inst.blocks.blocks_needed(req.num_prompt_tokens + 1) > inst.blocks.num_blocks:
                self._fail(t, now, f"the prompt needs {inst.blocks.blocks_needed(req.num_prompt_tokens + 1)} KV "
                                   f"blocks but the pool has {inst.blocks.num_blocks}")
                return
            self._sync(inst, now)
            inst.add(req)
            self._kick(inst, now)

        self.schedule(at, add)

    def _fail(self, t: Tracked, now: float, error: str) -> None:
        t.error, t.done, t.finish_time = error, True, now
        for pinst in (t.decode_inst, t.prefill_inst):
            if pinst is not None:
                pinst.release(t.job.prompt_len + (t.job.output_len if pinst is t.decode_inst else 0))
        t.decode_inst = t.prefill_inst = None
        if self.on_finish is not None:
            self.on_finish(t, now)

    # ---- instances ----------------------------------------------------------------------------
    def _kick(self, inst: SimInstance, now: float) -> None:
        """An idle engine wakes (a request, a claim or a load end came): its next step starts now, after the
        other events of this instant (what happened at once is seen by one step, not by two)."""
        if not inst.busy:
            inst.busy = True  # the wake-up is queued: a second kick at this instant adds nothing
            self.schedule(now, lambda at: self._step(inst, at))

    def _step(self, inst: SimInstance, now: float) -> None:
        pending = self._pending[inst.name]
        while pending:  # what the engine polls at a step's start (engine.pd.poll): claims, ended loads
            pending.pop(0)(now)
        res = inst.step()
        if res is None:
            inst.busy = False
            return
        for req in res.sched.start_loads:
            self._start_load(inst, req, now)
        if res.seconds <= 0:  # only loads started: nothing runs (the engine waits for a claim or a load end)
            inst.busy = False
            return
        inst.busy = True
        run = inst.plan_run(res, now) if self.skip_steps else None
        if run is None:
            self._schedule_step_end(inst, now + res.seconds, lambda at: self._step_end(inst, res, at))
            return
        inst.run = run
        self._schedule_step_end(inst, run.ends[-1], lambda at: self._run_end(inst, run, at))

    # ---- skipped decode steps -----------------------------------------------------------------
    def _run_end(self, inst: SimInstance, run: DecodeRun, now: float) -> None:
        if inst.run is not run:
            self.events -= 1  # cut short by _sync, which scheduled its own step end
            return
        inst.run = None
        last = len(run.ends)
        self._apply(inst, run, last - 1, last)
        self._step_end(inst, run.result(last), now)

    def _sync(self, inst: SimInstance, now: float) -> None:
        """Before an outside event touches `inst` at `now`: its skipped steps that ended by `now` applied (their
        step-end events would have come first), and the step under way made an ordinary step event again."""
        run = inst.run
        if run is None:
            return
        inst.run = None
        done = bisect_right(run.ends, now)  # < len(run.ends): the run's own end event comes before `now`'s
        self._apply(inst, run, done, done + 1)
        res = run.result(done + 1)
        self._schedule_step_end(inst, run.ends[done], lambda at: self._step_end(inst, res, at))

    def _apply(self, inst: SimInstance, run: DecodeRun, commits: int, allocs: int) -> None:
        """Skipped steps up to `commits` applied to the instance, and their tokens' times to the clients'."""
        first = run.committed
        inst.advance(run, commits, allocs)
        if commits <= first:
            return
        egress = inst.profile.overheads.egress_s
        out = [at + egress for at in run.ends[first:commits]]
        for req in run.rows:
            t = self._legs.get(req.request_id)
            if t is not None and not req.kv.send:  # a prefill leg's tokens count only when it ends
                t.token_times.extend(out)

    def _step_end(self, inst: SimInstance, res: StepResult, now: float) -> None:
        inst.commit(res)
        egress = inst.profile.overheads.egress_s
        for req in res.sampled:
            t = self._legs.get(req.request_id)
            if t is None:
                continue
            if req.kv.send:  # a prefill leg's token: it travels to the decode leg with the params
                if req.finished:
                    self._prefill_done(inst, req, t, now)
                continue
            t.token_times.append(now + egress)
            if req.finished:
                self._finish(t, req, now + egress)
        inst.busy = False
        self._step(inst, now)

    # ---- P/D ----------------------------------------------------------------------------------
    def _prefill_done(self, p: SimInstance, p_req: Request, t: Tracked, now: float) -> None:
        d, d_req = p_req.sim_pair  # type: ignore[attr-defined]
        t.cached_tokens = max(p_req.num_cached_tokens, 0)
        d_req.sim_producer = (p, p_req)  # type: ignore[attr-defined]
        at = now + p.profile.handoff.params_s

        def delivered(at_now: float) -> None:
            if t.prefill_inst is not None:
                t.prefill_inst.release(t.job.prompt_len)
                t.prefill_inst = None
            # the params deliver the producer's first token, adopted as output 0 unless it would end the
            # request (engine/pd/first_token.py `adopt_first_token`: then the last prompt token is recomputed)
            d_req.output_token_ids.append(OUTPUT_TOKEN)
            if d_req.check_stop(OUTPUT_TOKEN):
                d_req.output_token_ids.pop()
                d_req.finish_reason = d_req.stop_reason = None
            else:
                d_req.kv.first_token = FirstToken(OUTPUT_TOKEN)
            self._admit(d, d_req, at_now, t, streams=True)

        self.schedule(at, delivered)

    def _start_load(self, d: SimInstance, req: Request, now: float) -> None:
        p, p_req = req.sim_producer  # type: ignore[attr-defined]
        t = self._legs[req.request_id]
        claim_at = now + p.profile.handoff.claim_s
        nbytes = (req.kv.remote_tokens(req.num_prompt_tokens) - req.num_computed_tokens) \
            * p.profile.kv_bytes_per_token

        def claimed(at: float) -> None:
            def emit(step_now: float) -> None:  # polled at the decode engine's next step start
                if req.kv.first_token is not None and not req.kv.first_token_sent:
                    t.token_times.append(step_now + d.profile.overheads.egress_s)
                    req.kv.first_token_sent = True
            if req.kv.first_token is not None:
                self._sync(d, at)
                self._pending[d.name].append(emit)
                self._kick(d, at)
            self.links.start(at, p.name, d.name, nbytes, read_done)

        def read_done(at: float) -> None:
            self._sync(p, at)
            p.release_held(p_req.request_id)
            p_req.sim_pair = req.sim_producer = None  # type: ignore[attr-defined]  # no cycle keeps them
            self._kick(p, at)

            def ended(step_now: float) -> None:
                if req.kv.first_token is not None and not req.kv.first_token_sent:
                    t.token_times.append(step_now + d.profile.overheads.egress_s)
                    req.kv.first_token_sent = True
                req.num_cached_tokens = req.kv.remote_tokens(req.num_prompt_tokens)
                d.scheduler.end_load(req, ok=True)
            self._sync(d, at)
            self._pending[d.name].append(ended)
            self._kick(d, at)

        self.schedule(claim_at, claimed)

    def _finish(self, t: Tracked, req: Request, at: float) -> None:
        t.done, t.finish_time = True, at
        if not self.disaggregated:
            t.cached_tokens = max(req.num_cached_tokens, 0)
        self._legs.pop(req.request_id, None)
        self._legs.pop(f"{t.job.index}-p", None)
        if t.decode_inst is not None:
            t.decode_inst.release(t.job.prompt_len + t.job.output_len)
            t.decode_inst = None
        if self.on_finish is not None:
            self.on_finish(t, at)
