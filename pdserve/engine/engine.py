"""The step loop: admit, schedule, run, sample, finish. Synchronous; AsyncEngine drives it from a thread."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.commands import LoopState
from pdserve.engine.events import (
    DeliveryRefused,
    Emit,
    EngineEvent,
    Finish,
    FirstTokenAdopted,
    LoadEnded,
    ParamsRefused,
    Schedule,
)
from pdserve.engine.extension import EngineExtension, NoExtension
from pdserve.engine.grammars import Grammars
from pdserve.engine.request import Request, Status
from pdserve.engine.runner.async_decode import DecodePipeline, InflightDecode, async_scheduling_enabled
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec_decode.decoder import SpecDecoder
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.stats import EngineStats
from pdserve.engine.step_log import StepLog
from pdserve.kv_events.events import KVEventBatch
from pdserve.model.config import ModelConfig, derived_max_model_len, load_model_config, verify_max_model_len
from pdserve.model.model_dir import resolve_model_dir
from pdserve.types.engine_config import DEFAULT_GPU_BUDGET, EngineConfig
from pdserve.types.kv_events_config import KVEventsConfig
from pdserve.types.outputs import RequestOutput, TokenLogprob
from pdserve.types.sampling_params import ParamError, SamplingParams
from pdserve.types.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    # what builds the engine's extension (engine/extension.py), called once the KV pool exists
    ExtensionFactory = Callable[["LLMEngine"], EngineExtension]

log = logging.getLogger("pdserve.engine")
PARKED_READ_WAIT_S = 0.001  # the longest a step waits for a disk-tier read when nothing else can run


class PromptTooLongError(ParamError):
    pass


def read_eos_ids(model_dir: Path | None, model_cfg: ModelConfig) -> frozenset[int]:
    ids = set(model_cfg.eos_token_ids)
    gen = model_dir / "generation_config.json" if model_dir else None
    if gen is not None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig, extension_factory: ExtensionFactory | None = None):
        self.config = config
        self.model_dir = resolve_model_dir(config.model, config.load_format)
        self.model_cfg = load_model_config(self.model_dir)
        self.max_model_len = verify_max_model_len(config.max_model_len, derived_max_model_len(
            self.model_cfg.max_position_embeddings, self.model_cfg.rope_scaling))  # before loading weights
        self.eos_token_ids = read_eos_ids(self.model_dir, self.model_cfg)
        self.spec_config = SpeculativeConfig.parse(config.speculative_config)
        if config.tensor_parallel_size > 1:
            if self.spec_config is not None and self.spec_config.method == "draft_model":
                raise ValueError("speculative_config: a draft model is not built for tensor parallelism yet "
                                 "(tensor_parallel_size must be 1; ngram works)")
            from pdserve.engine.runner.tp_executor import (
                start_tensor_parallel,  # workers only when they exist
            )

            self.runner = start_tensor_parallel(config, self.model_cfg, self.model_dir)
        else:
            self.runner = ModelRunner(config, self.model_cfg, self.model_dir,
                                      extra_block_bytes=self._draft_block_bytes(config))
        try:
            self._init_rest(config, extension_factory)
        except BaseException:
            self.runner.shutdown()  # tensor-parallel workers must not outlive a failed start
            raise

    def _draft_block_bytes(self, config: EngineConfig) -> int:
        """A draft model's KV bytes per block (its pool has the target's block count), else 0."""
        spec = self.spec_config
        if spec is None or spec.model is None:
            return 0
        from pdserve.engine.runner.model_runner import resolve_device, resolve_dtype
        from pdserve.engine.spec_decode.draft import draft_block_bytes, load_draft_config

        _, draft_cfg = load_draft_config(spec.model, config)
        dtype = resolve_dtype(config.dtype, draft_cfg, resolve_device(config.device))
        return draft_block_bytes(draft_cfg, config.block_size, dtype)

    def _init_rest(self, config: EngineConfig, extension_factory: ExtensionFactory | None) -> None:
        self.extension: EngineExtension = NoExtension()
        self.grammars = Grammars(config.tokenizer or str(self.model_dir), self.model_cfg.vocab_size,
                                 self.eos_token_ids, config.structured_outputs_config)
        events_cfg = KVEventsConfig.from_json(config.kv_events_config)
        publish = events_cfg is not None and events_cfg.active and config.enable_prefix_caching
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                   enable_events=publish)
        self.kv_events = None  # the ZMQ publisher of the pool's KV events, when --kv-events-config enables it
        default_budget = DEFAULT_GPU_BUDGET if self.runner.device.type == "cuda" else 2048
        budget = config.max_num_batched_tokens or default_budget
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, budget, config.enable_chunked_prefill,
                                   config.prefill_only_chunk(self.runner.device.type))
        spec = self.spec_config
        draft = None
        if spec is not None and spec.model is not None:
            from pdserve.engine.spec_decode.draft import DraftModelProposer

            draft = DraftModelProposer(spec.model, config, self.model_cfg, self.runner.num_blocks, self.blocks,
                                       budget)
        # speculative decoding (pdserve.engine.spec_decode): drafts verified in one step; None: off
        self.spec = SpecDecoder(spec, draft) if spec is not None else None
        # async scheduling (pdserve.engine.runner.async_decode): decode steps launched ahead; None: every step waits.
        # Not with speculation: a step's inputs (its drafts) depend on the previous step's accepted tokens.
        self.pipeline = DecodePipeline(self.scheduler, self.blocks, self.runner) \
            if async_scheduling_enabled(config.async_scheduling, self.runner.device.type) and self.spec is None \
            else None
        self._inflight: InflightDecode | None = None  # a decode step launched and not yet taken in
        self.tiers = None  # the KV offload tiers (host memory, disk) behind the pool, when configured
        self.tier_loader = None
        if config.kv_offloading:
            from pdserve.engine.tier_loader import TierLoader  # the tiers' threads only where they are on

            self.tier_loader = TierLoader.start(config, self.runner, self.blocks, self.scheduler, events=publish)
            self.tiers = self.tier_loader.tiers
        self.requests: dict[str, Request] = {}
        if extension_factory is not None:
            try:
                self.extension = extension_factory(self)
            except BaseException:
                self._shutdown_services()
                raise
        if self.extension.layer_hook is not None:  # the model reports each finished layer of a step to it
            self.runner.layer_hook = self.extension.layer_hook
        if publish:
            from pdserve.kv_events.publisher import ZmqEventPublisher  # pyzmq only where events are on

            try:
                self.kv_events = ZmqEventPublisher(events_cfg)
            except BaseException:
                self._shutdown_services()
                raise
        self.num_finished = 0
        self.step_log = StepLog.from_env(config.role)
        if config.warm_up or (config.warm_up is None and self.runner.device.type == "cuda"):
            try:
                self._warm_up()
            except BaseException:
                self._shutdown_services()
                raise

    def _shutdown_services(self) -> None:
        """Stops what the engine started beside the model runner (its extension, the KV event publisher, the
        offload tiers), each if it was started: on shutdown and when the constructor fails part-way."""
        self.extension.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.tiers is not None:
            self.tiers.shutdown()

    def reset_client_counters(self) -> None:
        """The counters a client sees back at zero, after work that was nobody's (the warm-up, the prefill cost
        calibration): finished requests, prefix and external cache hits, the tiers' counters, step timing."""
        self.num_finished = 0
        self.blocks.prefix_queries = self.blocks.prefix_hits = 0
        self.blocks.external_queries = self.blocks.external_hits = 0
        if self.tiers is not None:
            self.tiers.counters.clear()
        self.runner.step_timing.reset()

    def _warm_up(self) -> None:
        """Requests through a full-budget prefill, a mixed prefill+decode step, decode graphs and the
        sampler before serving: the first clients would otherwise pay the kernels' JIT compilation and
        first-use costs (2.3 s of TTFT for the 8B shape's first 8k prompt on the H200)."""
        bs = self.config.block_size
        pool_tokens = (self.blocks.num_blocks // 2 - 1) * bs
        n = max(1, min(self.scheduler.max_num_batched_tokens, self.max_model_len - 4, pool_tokens))
        prompt = [i % self.model_cfg.vocab_size for i in range(1, n + 1)]
        short = prompt[: min(n, 3 * bs + 5)][::-1]
        self.add_request("__warmup_0", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        for step in range(64):  # bounded: two 3-token requests finish in a handful of steps
            if step == 1:
                self.add_request("__warmup_1", short, SamplingParams(max_tokens=3, ignore_eos=True))
            self.step()
            if step >= 1 and not self.requests:
                break
        for rid in list(self.requests):
            self.abort_request(rid)
        while self._inflight is not None:  # a step launched ahead for the aborted requests: taken in, dropped
            self.step()
        # library kernels' per-shape plans (cuDNN's attention for long prefill chunks): ~65 ms each if built
        # at a long prompt's first chunks instead
        warm = getattr(self.runner.backend, "warm_up", None)
        if warm is not None:
            c = self.model_cfg
            n_plans = 0
            s = self.scheduler
            # the budget's chunks and the longer one a step without decode rows may take
            for chunk in sorted({s.max_num_batched_tokens, max(s.max_num_batched_tokens, s.prefill_only_chunk_tokens)}):
                n_plans += warm(c.num_heads, c.num_kv_heads, c.head_dim, self.runner.dtype, self.runner.device,
                                chunk, self.max_model_len)
            if n_plans:
                log.info("built %d attention plans for long prefill chunks", n_plans)
        self.reset_client_counters()
        if self.spec is not None:
            self.spec.stats = SpecDecodeStats(self.spec.config.num_speculative_tokens)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    payload: object | None = None) -> None:
        """Raises ParamError for a client mistake; the engine is unaffected. `payload`: what the caller
        attached for the engine's extension, passed on unread (`EngineExtension.on_added`)."""
        if request_id in self.requests:
            raise ParamError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ParamError("the prompt is empty", "prompt")
        vocab = self.model_cfg.vocab_size
        bad = None
        # C-level passes for the common case (an 8k-token prompt: ~0.1 ms instead of ~1 ms); the loop only
        # finds the culprit
        if not (set(map(type, prompt_token_ids)) <= {int, bool} and min(prompt_token_ids) >= 0
                and max(prompt_token_ids) < vocab):
            bad = next((t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= vocab), None)
        if bad is not None:
            raise ParamError(f"token id {bad} is out of vocabulary (size {vocab})", "prompt")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            bad = next((t for t in ids or () if not 0 <= t < vocab), None)
            if bad is not None:
                raise ParamError(f"{name} has token id {bad}, out of vocabulary (size {vocab})", name)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {n} input tokens; at least one output token must fit.", "prompt"
            )
        if self.blocks.blocks_needed(n + 1) > self.blocks.num_blocks:
            raise PromptTooLongError(
                f"the prompt needs {self.blocks.blocks_needed(n + 1)} KV blocks but the pool has "
                f"{self.blocks.num_blocks}", "prompt"
            )
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs is not None else None
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, self.max_model_len)
        req.grammar = grammar
        events = self.extension.on_added(req, payload)  # raises ParamError before anything is registered
        self.requests[request_id] = req  # registered even when its events do not schedule it yet
        self._apply(events)

    def call_extension(self, command: object) -> tuple[object, list[RequestOutput]]:
        """One of the extension's own commands: its answer and the outputs its events made. Raises what the
        extension raises (DeliveryRefused: a request ended because the command was refused, with its outputs)."""
        result, events = self.extension.call(command)
        return result, self._apply(events)

    def _apply(self, events: Iterable[EngineEvent]) -> list[RequestOutput]:
        """What the extension asks of the loop (engine/events.py), in order; the outputs it makes."""
        outputs: list[RequestOutput] = []
        for ev in events:
            match ev:
                case Schedule(req):
                    self.scheduler.add(req)
                case FirstTokenAdopted(req):
                    # a seeded request then draws its next tokens as a collocated run does after this one
                    self.runner.sampler.skip_draw(req, self.runner.device, self.model_cfg.vocab_size)
                case LoadEnded(req, ok, resume):
                    self.scheduler.end_load(req, ok, resume=resume)
                case Emit(req):
                    outputs.append(self._emit(req))
                case Finish(req):
                    outputs.append(self._finish(req, completed=False))
                case ParamsRefused(req, error):
                    raise DeliveryRefused(str(error), [self._finish(req, completed=False)]) from error
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        req.finish_reason = "abort"
        if self.extension.on_aborted(req):  # e.g. a read still writing into its blocks: it finishes when it ends
            return None
        if self.tier_loader is not None:
            self.tier_loader.forget(request_id)
        self.scheduler.remove(req)
        return self._finish(req, completed=False)

    def has_unfinished(self) -> bool:
        """Requests in the engine, or a step launched ahead still to be taken in (its rows may all have ended:
        the next step() takes it in)."""
        return bool(self.requests) or self._inflight is not None

    def loop_state(self) -> LoopState:
        """What a loop that steps this engine (AsyncEngine's thread) decides on, in one snapshot."""
        s = self.scheduler
        bg = self.extension.background()
        parked = self.tier_loader is not None and bool(self.tier_loader.parked)
        return LoopState(num_queued=len(s.waiting), unfinished=self.has_unfinished(), schedulable=s.has_work(),
                         background=bg.steps, idle_poll=bg.keeps or bg.in_flight, polled=bg.in_flight or parked)

    def idle(self) -> None:
        """Between steps with nothing to run: publish what the tiers did meanwhile (the disk tier's writes end
        in the background), let the runner note the idle time."""
        self.publish_kv_events()
        self.runner.observe_idle()

    def on_background_event(self, wake: Callable[[], None]) -> None:
        """`wake` is called (from any thread) when work a step must take in arrives between steps (the
        extension's); a loop sleeping between steps wakes at once instead of at its next poll."""
        self.extension.set_wake(wake)

    def check_health(self) -> None:
        """Raises when the engine cannot run another step (a tensor-parallel worker died)."""
        self.runner.check_alive()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """One batch with whatever the pool (and the tiers) gained or lost since the last one, as vLLM's
        scheduler publishes once per step; the async loop also calls it when idle (disk writes finish
        in the background)."""
        if self.kv_events is not None:
            events = self.blocks.take_events(self.tiers.take_events() if self.tiers is not None else ())
            if events:
                self.kv_events.publish(KVEventBatch(ts=time.time(), events=events))

    def _step(self) -> list[RequestOutput]:
        outputs = self._apply(self.extension.poll())
        if any(o.new_token_ids for o in outputs):
            # the extension gave tokens that did not need the model: hand them out now rather than after this
            # step's model run (~6 ms on an 8B model); the caller's next step runs the model
            return outputs
        t_start = time.perf_counter()
        counters0 = self.step_log.counters() if self.step_log is not None else None
        if self._inflight is not None:
            outputs.extend(self._advance(t_start, counters0))
            return outputs
        self.extension.before_schedule(self.scheduler.running, self.scheduler.waiting)
        if self.tier_loader is not None:
            self.tier_loader.before_schedule()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        outputs.extend(self._apply(self.extension.after_schedule(sched)))
        if not sched.scheduled:
            if not outputs and self.tier_loader is not None and self.tier_loader.parked:
                # only disk-tier reads are left: wait (briefly, bounded) for one instead of returning at once,
                # so a caller stepping in a loop (LLM.generate, the async step thread) does not spin on them
                self.tier_loader.tiers.wait_for_read(PARKED_READ_WAIT_S)
            return outputs
        now = time.monotonic()
        for req, _ in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        if self.pipeline is not None:
            self._inflight = self.pipeline.launch_scheduled(sched.scheduled)
            if self._inflight is not None:
                outputs.extend(self._advance(t_start, counters0))
                return outputs
        t_sched = time.perf_counter()
        timing = self.runner.step_timing
        graphs0, wait0 = timing.graph_steps, timing.wait_s
        if self.spec is not None and any(req.spec_token_ids for req, _ in sched.scheduled):
            t_exec = self._verify_step(sched.scheduled, outputs)
        else:
            reqs, tokens, logprobs = self.runner.execute(sched.scheduled)
            t_exec = time.perf_counter()
            for req, n in sched.scheduled:
                req.num_computed_tokens += n
                self.blocks.cache_full_blocks(req)
            now = time.monotonic()
            for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
                self._take_token(req, tok, lp, now, outputs)
        if self.step_log is not None:
            self.step_log.record(
                t_start, t_sched, t_exec, time.perf_counter(), seqs=len(sched.scheduled),
                tokens=sched.num_tokens, prefill_tokens=sum(n for _, n in sched.scheduled if n > 1),
                graph=timing.graph_steps > graphs0, wait_s=timing.wait_s - wait0, outputs=len(outputs),
                start_counters=counters0, threads=getattr(self.runner, "last_step_threads", None))
        return outputs

    def _verify_step(self, scheduled: list[tuple[Request, int]], outputs: list[RequestOutput]) -> float:
        """A step with drafts to verify (engine.spec_decode): the logits of every draft position, the
        rejection sampler's tokens, then each request takes its tokens one by one, as if they came from
        that many plain steps: each may end it (a stop token, max_tokens, the grammar), and whatever follows
        is dropped. Only accepted drafts' positions count as computed. Returns when the model run ended."""
        assert self.spec is not None
        reqs, logits, argmax = self.runner.execute_verify(scheduled)
        verified = self.spec.verify(self.runner.sampler, logits, reqs, argmax) if logits is not None else []
        t_exec = time.perf_counter()
        for req, n in scheduled:
            req.num_computed_tokens += n - len(req.spec_token_ids)  # through the last token before the drafts
            self.blocks.cache_full_blocks(req)
            req.spec_token_ids = []
        now = time.monotonic()
        for v in verified:
            req = v.req
            for i, (tok, lp) in enumerate(zip(v.token_ids, v.logprobs, strict=True)):
                if i:  # token i - 1 was an accepted draft: its K/V, written in this step, is now valid
                    req.num_computed_tokens += 1
                    self.blocks.cache_full_blocks(req)
                if self._append_token(req, tok, lp, now, outputs):
                    break
            else:
                outputs.append(self._emit(req))  # one output with all of this step's tokens
        return t_exec

    def _take_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float,
                    outputs: list[RequestOutput]) -> None:
        """A sampled token into its request: emitted, or the request finished by it."""
        if not self._append_token(req, tok, lp, now, outputs):
            outputs.append(self._emit(req))

    def _append_token(self, req: Request, tok: int, lp: TokenLogprob | None, now: float,
                      outputs: list[RequestOutput]) -> bool:
        """A sampled token into its request, not yet emitted; True when it ended the request (finished, its
        output with every token not yet emitted in `outputs`)."""
        req.output_token_ids.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.check_stop(tok) or (req.grammar is not None and self.grammars.advance(req, tok)):
            self.scheduler.remove(req)
            outputs.append(self._finish(req, completed=True))
            return True
        return False

    def _advance(self, t_start: float, counters0: tuple[int, int, int] | None) -> list[RequestOutput]:
        """Async scheduling: launch the step after the one in flight when it qualifies (pipeline.launch_next),
        then take the one in flight in: its tokens into their requests, the rows of requests that ended
        meanwhile dropped. Without a launch the pipeline is empty afterwards and the next step is scheduled
        normally."""
        assert self.pipeline is not None and self._inflight is not None
        cur = self._inflight
        parked = self.tier_loader is not None and bool(self.tier_loader.parked)
        self._inflight = self.pipeline.launch_next(cur, waiting_elsewhere=parked)
        t_sched = time.perf_counter()
        tokens = self.runner.collect_decode(cur.launched)
        t_exec = time.perf_counter()
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for req, pos, tok in zip(cur.reqs, cur.positions, tokens, strict=True):
            if req.finished or req.num_computed_tokens != pos:
                continue  # ended at the step before (or aborted since): this row ran ahead for nothing
            req.num_computed_tokens = pos + 1
            self.blocks.cache_full_blocks(req)
            self._take_token(req, tok, None, now, outputs)
        if self.step_log is not None:
            n = len(cur.reqs)
            self.step_log.record(
                t_start, t_sched, t_exec, time.perf_counter(), seqs=n, tokens=n, prefill_tokens=0, graph=True,
                wait_s=cur.launched.wait_s, outputs=len(outputs), start_counters=counters0,
                threads=None)
        return outputs

    def _emit(self, req: Request, finished: bool = False) -> RequestOutput:
        new = req.output_token_ids[req.num_emitted :]
        lps = req.output_logprobs[req.num_emitted :] if req.params.logprobs is not None else None
        # prompt logprobs travel once, with the first output (they are complete once a token is sampled)
        prompt_lps = (req.prompt_logprobs if req.params.prompt_logprobs is not None and req.num_emitted == 0
                      and len(req.prompt_logprobs) == req.num_prompt_tokens else None)
        req.num_emitted = len(req.output_token_ids)
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            new_token_ids=new,
            new_logprobs=lps,
            num_output_tokens=len(req.output_token_ids),
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            error=req.error if finished else None,
            error_status=req.error_status,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=req.metrics,
            prompt_logprobs=prompt_lps,
        )
        self.extension.on_output(req, out)
        return out

    def _finish(self, req: Request, completed: bool) -> RequestOutput:
        """The request ends (its output with what was not yet emitted); its blocks are freed unless the extension
        keeps them (`completed`: it ended by a stop or its length, not aborted or failed)."""
        req.status = Status.FINISHED
        req.metrics.finished_time = time.monotonic()
        if self.step_log is not None:
            self.step_log.record_request(
                req.request_id, req.metrics, prompt_tokens=req.num_prompt_tokens,
                cached_tokens=max(req.num_cached_tokens, 0), output_tokens=len(req.output_token_ids),
                finish_reason=req.finish_reason)
        self.requests.pop(req.request_id, None)
        self.runner.sampler.forget(req.request_id)
        self.num_finished += 1
        if not self.extension.on_finished(req, completed):
            self.blocks.release(req)
        return self._emit(req, finished=True)

    @property
    def num_held(self) -> int:
        """The stats snapshot's count of finished requests whose blocks are held for a peer (tests read it)."""
        return self.stats().num_held

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """One snapshot: the loop's counts, then its extension's."""
        s = self.scheduler
        return self.extension.contribute(EngineStats(
            num_running=len(s.running),
            num_waiting=s.num_waiting + (len(self.tier_loader.parked) if self.tier_loader else 0),
            kv_cache_usage=self.blocks.usage,
            num_blocks=self.blocks.num_blocks,
            num_free_blocks=self.blocks.num_free_blocks,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            num_preemptions=s.num_preemptions,
            external_prefix_cache_queries=self.blocks.external_queries,
            external_prefix_cache_hits=self.blocks.external_hits,
            kv_tiers=self.tiers.stats() if self.tiers is not None else None,
            spec_decode=self.spec.stats.snapshot() if self.spec is not None else None,
            num_queued=len(s.waiting),
        ))

    def shutdown(self) -> None:
        self._shutdown_services()
        self.runner.shutdown()
        if self.step_log is not None:
            self.step_log.close()
