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

The proxy is the proxy's code (proxy.py): each request is read by `client_request` and planned by `plan.decide`
(Local or Pair; the prefill instance first, then push or the early decode leg; the multi-turn history decision),
its legs' instances are chosen by `PairChooser` as the legs choose them, and the legs' load accounting (`acquire`
/ `release`: legs in flight and outstanding tokens) is done where the proxy does it. Its coroutines are driven to
completion synchronously: with healthy instances they never wait.

The paths, as the real system takes them:
- Local (collocated, or conditional disaggregation): the chosen instance computes the prompt and decodes; tokens
  reach the client `overheads.egress_s` after the step that sampled them.
- P/D pull with the early decode leg (pdserve's defaults): the decode leg waits at its instance for the prefill's
  params (not scheduled); the prefill instance computes the prompt with max_tokens 1 and holds its blocks; its
  params reach the decode leg `handoff.params_s` later (the request is then scheduled there:
  `Scheduler.schedule` allocates its blocks and starts the load); the lease is claimed `handoff.claim_s` after the
  load starts, and the adopted first token goes out at the decode engine's next step boundary (the engine polls
  claims between steps); the READ (the prompt's KV bytes the decode lacks) runs on the links, contended; when it
  ends the producer's blocks are freed and the request joins the running set at the consumer's next step
  (`Scheduler.end_load`). Without an early leg the decode instance is chosen when the params reach the proxy.
- P/D push (`--kv-transfer-mode push`): both legs at once; the decode allocates the prompt's blocks on admission
  and registers them (`handoff.claim_s` later at the prefill); the prefill WRITEs them layer by layer or whole
  (push.py); the push's completion frees the prefill's blocks and brings the first token, which the decode adopts
  at its next step boundary.
- Multi-turn history (`--kv-history`): a decode leg's conversation is kept by the engine's `Holds` under a lease
  (`decoder_kv_blocks_ttl`, evicted oldest first when the pool runs short); the proxy remembers its params, and
  when it decides `pull` the next turn's prefill leg carries them: the engine's `Admission` matches the held blocks
  against the prompt, the scheduler reads the ones its own cache lacks (a claim, then a READ from the holder),
  and the holder's lease ends with the read. A lease gone by the claim (evicted, expired) is recomputed.
- Routing by cached prefix (`--kv-events`): instances' KV events (the engine's `BlockManager` queues them) reach
  the proxy's index when the step that made them ends; the proxy's lookup and cost do the rest.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from array import array
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.pd import (
    FirstToken,
    HeldKVParams,
    KVTransferParams,
    LoadParams,
    PushParams,
    prefix_prefill_params,
)
from pdserve.engine.pd.kv_handoff import KVHandoff, KVState
from pdserve.engine.request import Request
from pdserve.kv_events.events import KVEventBatch
from pdserve.sim.instance import MAX_MODEL_LEN, OUTPUT_TOKEN, DecodeRun, SimInstance, StepResult
from pdserve.sim.link import Links
from pdserve.sim.options import SimOptions
from pdserve.sim.profile import Profile
from pdserve.sim.push import PushTransfer
from pdserve.sim.seams import HistoryLease, SimConnector, SimConsumer, SimProducer
from pdserve.sim.workload import Job
from pdserve.types.push_pipeline import push_layer_by_layer
from pdserve.types.sampling_params import SamplingParams


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
    decode_inst: Any = None  # proxy Instance of the leg that streams (released when it ends)
    prefill_inst: Any = None
    decode_work: int = 0  # what each leg counts in its instance's outstanding tokens (acquire / release)
    prefill_work: int = 0
    sreq: Any = None  # the proxy's read of the request (proxy.SimRequest)
    history: str | None = None  # the proxy's multi-turn decision for it (pull, p_cache, recompute, none)


class Deployment:
    """Instances, the proxy's pools over them, the links, and the event loop."""

    def __init__(self, prefill: list[Profile], decode: list[Profile], collocated: list[Profile],
                 *, seed_rotation: int = 0, skip_steps: bool = True, options: SimOptions | None = None) -> None:
        from pdserve.launch.config import LaunchConfig, Topology
        from pdserve.proxy.pool import Pool
        from pdserve.sim.proxy import SimProxy

        opts = (options or SimOptions()).validate()
        self.options = opts
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, Callable[[float], None]]] = []
        self.skip_steps = skip_steps  # decode stretches as one event each (DecodeRun); False: every step
        self._seq = itertools.count()
        self.instances: dict[str, SimInstance] = {}
        self.disaggregated = bool(prefill)
        self.push = self.disaggregated and opts.kv_transfer_mode == "push"
        p_pool, d_pool = Pool("prefill"), Pool("decode")
        self._proxy_inst: dict[str, Any] = {}
        self._by_url: dict[str, SimInstance] = {}
        publishers: dict[str, int] = {}
        launch = LaunchConfig(topology=Topology(len(prefill), len(decode), len(collocated)), kv_events=opts.kv_events)
        port = itertools.count(10000)
        for role, profiles, pool in (("prefill", prefill, p_pool), ("decode", decode, d_pool),
                                     ("collocated", collocated, d_pool)):
            events = launch.kv_events_in(role)
            for i, prof in enumerate(profiles):
                name = f"{role}-{i}"
                inst = SimInstance(name, role, prof, connector=self._connector(name, role, prof), events=events)
                inst.order = len(self.instances)
                self.instances[name] = inst
                pinst = pool.add(f"http://sim-{name}:{next(port)}", healthy=True)
                SimProxy.learn(pinst, role if role != "collocated" else "decode", opts.kv_transfer_mode)
                pinst.sim_name = name  # type: ignore[attr-defined]
                self._proxy_inst[name] = pinst
                self._by_url[pinst.url] = inst
                inst.url = pinst.url  # type: ignore[attr-defined]
                if events:
                    publishers[pinst.url] = prof.engine.block_size
        cfg = dataclasses.replace(opts.proxy, kv_history=opts.kv_history and self.disaggregated)
        self.proxy = SimProxy(cfg, p_pool, d_pool, lambda: self.now, run_now, publishers)
        self.chooser = self.proxy.state.pairing
        self._fleet = self.proxy.state.fleet
        self._publishing = {self._by_url[url] for url in publishers} if self._fleet is not None else set()
        self._stretches: set[SimInstance] = set()  # instances whose decode stretch is under way (DecodeRun)
        self.links = Links(lambda name: self.instances[name].profile.handoff.link_bytes_per_s, self.schedule)
        self.tracked: list[Tracked] = []
        self._pending: dict[str, list[Callable[[float], None]]] = {n: [] for n in self.instances}
        self._legs: dict[str, Tracked] = {}  # request id of a leg -> its client request
        self.events = 0
        self.on_finish: Callable[[Tracked, float], None] | None = None  # the workload's (multi-turn next turn)

    def _connector(self, name: str, role: str, prof: Profile) -> SimConnector:
        """The engine's P/D seams for one instance (seams.py): `pdserve up`'s settings for its role."""
        opts = self.options
        holder = role == "decode" and opts.kv_history  # bidirectional_kv_xfer: decode legs keep conversations
        producer = SimProducer(name, lambda: self.now, ttl_s=opts.decoder_kv_blocks_ttl,
                               block_bytes=prof.kv_bytes_per_token * prof.engine.block_size, tp_size=prof.tp,
                               push=role == "prefill" and opts.kv_transfer_mode == "push",
                               on_history=lambda lease: self._history_held(name, lease))
        return SimConnector(producer, SimConsumer(self._declined), keeps_history=holder,
                            kv_recompute_threshold=opts.kv_recompute_threshold)

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
        from pdserve.sim.proxy import Local, Pair

        job = t.job
        if self._fleet is not None:  # the proxy's index as the step events would have left it by now
            for inst in list(self._stretches):
                self._sync(inst, now)
        sreq = t.sreq = self.proxy.read(job)
        plan = sreq.plan
        decision = getattr(plan, "decision", None)  # a Pair's multi-turn history decision (None without)
        t.history = decision.decision if decision is not None else None
        if isinstance(plan, Local):
            pinst = self.proxy.local_instance(sreq)
            t.decode_work = self.proxy.work(sreq, pinst, sreq.req.decode_tokens)
            pinst.acquire(t.decode_work)
            t.decode_inst = pinst
            inst = self.instances[pinst.sim_name]
            req = self._request(f"{job.index}", job, inst, max_tokens=job.output_len, kv=KVHandoff())
            self._legs[req.request_id] = t
            job.forget_hashes()
            self._admit(inst, req, now + inst.profile.overheads.ingress_s, t)
            return
        if not isinstance(plan, Pair) or plan.prefill is None:
            self._fail(t, now, f"the proxy's plan {type(plan).__name__}: no P/D pair (every instance is healthy: "
                               "a mismatch of transfer modes)")
            return
        p_pinst = plan.prefill
        p = self.instances[p_pinst.sim_name]
        t.prefill_inst = p_pinst
        if plan.push:  # push_pair.start_push_pair: the decode instance now, both legs at once
            d_pinst = self.proxy.pair_decode(p_pinst)
            t.decode_inst, t.decode_work = d_pinst, sreq.req.decode_tokens
            d_pinst.acquire(t.decode_work)
            t.prefill_work = sreq.req.tokens  # prefill_once(..., req.tokens)
        else:  # pull_pair: the prefill leg counts its uncached tokens; the early leg, if any, its decode tokens
            t.prefill_work = self.proxy.work(sreq, p_pinst, sreq.req.tokens)
            if plan.early is not None:
                t.decode_inst, t.decode_work = plan.early, sreq.req.decode_tokens
                plan.early.acquire(t.decode_work)
        p_pinst.acquire(t.prefill_work)
        p_req = self._request(f"{job.index}-p", job, p, max_tokens=1, kv=KVHandoff(send=True))
        if plan.history is not None:  # the prefill leg reads the held conversation back (Admission matches it)
            params = KVTransferParams.read(prefix_prefill_params(plan.history))
            p.admission.add(p_req, params)
        self._legs[p_req.request_id] = t
        if t.decode_inst is not None and not self.push:  # the early leg: it waits at its instance for the params
            p_req.sim_decode = self._decode_leg(t, job, self.instances[t.decode_inst.sim_name])  # type: ignore[attr-defined]
        if self.push:
            d = self.instances[t.decode_inst.sim_name]
            d_req = self._decode_leg(t, job, d)
            p_req.kv.push = d_req.kv.remote  # type: ignore[assignment]
            layer = push_layer_by_layer(self.options.push_pipeline,
                                        "VRAM" if p.profile.device.startswith("cuda") else "DRAM")
            layer = layer and job.prompt_len >= self.options.push_layerwise_min_tokens
            xfer = PushTransfer(d_req.kv.load_tokens(d_req.num_prompt_tokens), layer, self._push_post,
                                self._push_complete, pair=(p, p_req, d, d_req, t))
            p_req.sim_push = d_req.sim_push = xfer  # type: ignore[attr-defined]
            self._admit(d, d_req, now + d.profile.overheads.ingress_s, t)
        job.forget_hashes()
        self._admit(p, p_req, now + p.profile.overheads.ingress_s, t)

    def _decode_leg(self, t: Tracked, job: Job, d: SimInstance) -> Request:
        """The decode leg's request on `d`: it loads the prompt's KV (pull: once its params came; push: registered
        on admission) and, with --kv-history, keeps the conversation when it ends."""
        kv = KVHandoff(state=KVState.WAITING, keep_history=d.connector.keeps_history)
        if self.push:
            kv.remote = PushParams(f"sim-push-key-{job.index:08d}")
        d_req = self._request(f"{job.index}-d", job, d, max_tokens=job.output_len, kv=kv)
        self._legs[d_req.request_id] = t
        return d_req

    def _request(self, rid: str, job: Job, inst: SimInstance, max_tokens: int, kv: KVHandoff) -> Request:
        req = Request(rid, job.prompt_ids(), SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(),
                      MAX_MODEL_LEN, kv, arrival_time=job.arrival)
        req.block_hashes = list(job.block_hashes(inst.blocks.block_size))
        return req

    def _admit(self, inst: SimInstance, req: Request, at: float, t: Tracked) -> None:
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
        if t.done:
            return
        t.error, t.done, t.finish_time = error, True, now
        for pinst, work in ((t.decode_inst, t.decode_work), (t.prefill_inst, t.prefill_work)):
            if pinst is not None:
                pinst.release(work)
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
        for req in res.sched.dropped_loads:  # a held prefix not worth reading: its holder frees the lease
            self._declined(req.kv.remote)
        for req in res.sched.start_loads:
            self._start_load(inst, req, now)
        if res.seconds <= 0:  # only loads started: nothing runs (the engine waits for a claim or a load end)
            inst.busy = False
            return
        for req, n in res.sched.scheduled:  # a push prefill's chunk: its WRITEs go as its layers are computed
            xfer = getattr(req, "sim_push", None)
            if xfer is not None and req.kv.send:
                xfer.chunk(req.num_computed_tokens, n)
        inst.busy = True
        run = inst.plan_run(res, now) if self.skip_steps else None
        if run is None:
            self._schedule_step_end(inst, now + res.seconds, lambda at: self._step_end(inst, res, at))
            return
        inst.run = run
        self._stretches.add(inst)
        self._schedule_step_end(inst, run.end(len(run.ends)), lambda at: self._run_end(inst, run, at))

    # ---- skipped decode steps -----------------------------------------------------------------
    def _run_end(self, inst: SimInstance, run: DecodeRun, now: float) -> None:
        if inst.run is not run:
            self.events -= 1  # cut short by _sync, which scheduled its own step end
            return
        inst.run = None
        self._stretches.discard(inst)
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
        self._stretches.discard(inst)
        # bisect_right: < len(run.ends), the run's own end event comes before `now`'s
        done = int(run.ends.searchsorted(now, side="right"))
        self._apply(inst, run, done, done + 1)
        res = run.result(done + 1)
        self._schedule_step_end(inst, run.end(done + 1), lambda at: self._step_end(inst, res, at))

    def _apply(self, inst: SimInstance, run: DecodeRun, commits: int, allocs: int) -> None:
        """Skipped steps up to `commits` applied to the instance, and their tokens' times to the clients'; then
        the allocations of the steps up to `allocs` (their KV events belong to the step under way: published at
        its end, as the engine publishes once per step)."""
        first = run.committed
        inst.advance(run, commits, commits)
        self._publish(inst)
        inst.advance(run, commits, allocs)
        if commits <= first:
            return
        egress = inst.profile.overheads.egress_s
        out = (run.ends[first:commits] + egress).tolist()  # each at + egress, as the step events add it
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
        self._publish(inst)
        inst.busy = False
        self._step(inst, now)

    def _publish(self, inst: SimInstance) -> None:
        """The step's KV events into the proxy's index (LLMEngine.publish_kv_events; the subscription's latency
        is not simulated)."""
        if inst in self._publishing:
            events = inst.blocks.take_events()
            if events:
                assert self._fleet is not None
                self._fleet.index.apply(inst.url, KVEventBatch(ts=self.now, events=events))  # type: ignore[attr-defined]

    # ---- P/D ----------------------------------------------------------------------------------
    def _prefill_done(self, p: SimInstance, p_req: Request, t: Tracked, now: float) -> None:
        t.cached_tokens = max(p_req.num_cached_tokens, 0) + getattr(p_req, "sim_read_tokens", 0)
        at = now + p.profile.handoff.params_s

        def answered(at_now: float) -> None:  # the prefill's answer reached the proxy: its leg ends
            if t.prefill_inst is not None:
                t.prefill_inst.release(t.prefill_work)
                t.prefill_inst = None

        xfer = getattr(p_req, "sim_push", None)
        if xfer is not None:
            self.schedule(at, answered)
            xfer.prefill_finished()
            return
        job = t.job

        def delivered(at_now: float) -> None:
            answered(at_now)
            if t.done:
                return
            d_req = getattr(p_req, "sim_decode", None)
            if d_req is None:  # no early leg: the decode leg goes out now, to one that pairs
                t.decode_inst = self.proxy.pair_decode(self._proxy_inst[p.name])
                t.decode_work = t.sreq.req.decode_tokens
                t.decode_inst.acquire(t.decode_work)
                d_req = self._decode_leg(t, job, self.instances[t.decode_inst.sim_name])
            p_req.sim_decode = None  # type: ignore[attr-defined]
            d = self.instances[t.decode_inst.sim_name]
            d_req.sim_producer = (p, p_req)  # type: ignore[attr-defined]
            # the params deliver the producer's first token, adopted as output 0 unless it would end the
            # request (engine/pd/first_token.py `adopt_first_token`: then the last prompt token is recomputed)
            self._adopt_first_token(d_req)
            self._admit(d, d_req, at_now, t)

        self.schedule(at, delivered)

    @staticmethod
    def _adopt_first_token(d_req: Request) -> None:
        d_req.output_token_ids.append(OUTPUT_TOKEN)
        if d_req.check_stop(OUTPUT_TOKEN):
            d_req.output_token_ids.pop()
            d_req.finish_reason = d_req.stop_reason = None
        else:
            d_req.kv.first_token = FirstToken(OUTPUT_TOKEN)

    def _start_load(self, d: SimInstance, req: Request, now: float) -> None:
        if req.kv.prefix:
            self._start_prefix_load(d, req, now)
            return
        xfer = getattr(req, "sim_push", None)
        if xfer is not None:  # push: the registration of the blocks it lacks reaches the prefill a hop later
            p = xfer.pair[0]
            cached = req.num_computed_tokens
            self.schedule(now + p.profile.handoff.claim_s, lambda at: self._registered(xfer, cached, at))
            return
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
            self._end_load(d, req, at, ok=True)

        self.schedule(claim_at, claimed)

    def _end_load(self, d: SimInstance, req: Request, at: float, ok: bool,
                  before: Callable[[], None] | None = None) -> None:
        """The load's end, as the consumer engine polls it at its next step start."""
        t = self._legs.get(req.request_id)

        def ended(step_now: float) -> None:
            if before is not None:
                before()
            if t is not None and req.kv.first_token is not None and not req.kv.first_token_sent:
                t.token_times.append(step_now + d.profile.overheads.egress_s)
                req.kv.first_token_sent = True
            if ok and not req.kv.prefix:
                req.num_cached_tokens = req.kv.remote_tokens(req.num_prompt_tokens)
            d.scheduler.end_load(req, ok=ok)

        self._sync(d, at)
        self._pending[d.name].append(ended)
        self._kick(d, at)

    # ---- push -----------------------------------------------------------------------------------
    @staticmethod
    def _registered(xfer: PushTransfer, cached: int, at: float) -> None:
        if xfer.pair is not None:
            xfer.registered(cached)

    def _push_post(self, xfer: PushTransfer, tokens: int) -> None:
        p, _, d, _, _ = xfer.pair
        self.links.start(self.now, p.name, d.name, tokens * p.profile.kv_bytes_per_token, lambda at: xfer.landed())

    def _push_complete(self, xfer: PushTransfer) -> None:
        """Every WRITE landed after the prefill finished: its blocks go back, the decode adopts the first token
        (with the completion notification) at its next step and decodes."""
        p, p_req, d, d_req, t = xfer.pair
        at = self.now
        self._sync(p, at)
        if p_req.request_id in p.held:
            p.release_held(p_req.request_id)
        self._kick(p, at)
        xfer.pair = p_req.sim_push = d_req.sim_push = None  # type: ignore[attr-defined]  # no cycle keeps them
        self._end_load(d, d_req, at, ok=True, before=lambda: self._adopt_first_token(d_req))

    # ---- multi-turn history ---------------------------------------------------------------------
    def _holder(self, engine_id: str) -> SimInstance | None:
        return self.instances.get(engine_id)

    def _history_held(self, name: str, lease: HistoryLease) -> None:
        """A conversation is held on `name` until its lease ends (decoder_kv_blocks_ttl), unless read or evicted
        first."""
        inst = self.instances[name]

        def expire(at: float) -> None:
            producer = inst.connector.producer
            if producer.history.get(lease.lease_id) is lease and not lease.reading:
                self._end_history(inst, lease.lease_id, at)

        self.schedule(lease.expires_at, expire)

    def _end_history(self, inst: SimInstance, lease_id: str, at: float) -> None:
        self._sync(inst, at)
        inst.connector.producer.history.pop(lease_id, None)
        if lease_id in inst.holds.history:
            inst.holds.released([lease_id])
            self._kick(inst, at)

    def _declined(self, params: LoadParams) -> None:
        """A held prefix the reader will not read (no block matches, or not worth it): its holder frees it."""
        holder = self._holder(params.remote_engine_id)
        if holder is not None:
            self._end_history(holder, params.remote_request_id, self.now)

    def _start_prefix_load(self, inst: SimInstance, req: Request, now: float) -> None:
        """A prefill leg reads a held conversation back: the lease is claimed a hop later (refused when it is gone:
        the prompt is then computed here), the blocks it lacks are READ from the holder, the lease ends."""
        remote = req.kv.remote
        assert remote is not None and not isinstance(remote, PushParams)
        holder = self._holder(remote.remote_engine_id)
        lease_id = remote.remote_request_id

        def claimed(at: float) -> None:
            lease = holder.connector.producer.history.get(lease_id) if holder is not None else None
            if lease is None or lease.reading:
                self._end_load(inst, req, at, ok=False)  # gone (evicted, expired): recomputed here
                return
            lease.reading = True
            tokens = (req.kv.prefix_tokens or 0) - req.num_computed_tokens
            nbytes = tokens * holder.profile.kv_bytes_per_token

            def read_done(at_end: float) -> None:
                lease.reading = False
                self._end_history(holder, lease_id, at_end)  # one held history serves one read
                req.sim_read_tokens = tokens  # type: ignore[attr-defined]
                self._end_load(inst, req, at_end, ok=True)

            self.links.start(at, holder.name, inst.name, nbytes, read_done)

        self.schedule(now + (holder.profile.handoff.claim_s if holder is not None else 0.0), claimed)

    def _finish(self, t: Tracked, req: Request, at: float) -> None:
        t.done, t.finish_time = True, at
        if not self.disaggregated:
            t.cached_tokens = max(req.num_cached_tokens, 0)
        self._legs.pop(req.request_id, None)
        self._legs.pop(f"{t.job.index}-p", None)
        if t.decode_inst is not None:
            t.decode_inst.release(t.decode_work)
            held = req.result_kv_transfer_params
            if isinstance(held, HeldKVParams) and held.history and t.sreq is not None:
                # the decode answer's held history, remembered under the conversation (turn_history.keep_history)
                self.proxy.remember(t.sreq, held.to_json(), t.decode_inst.url, t.job.prompt_len)
            t.decode_inst = None
        t.sreq = None
        if self.on_finish is not None:
            self.on_finish(t, at)
