"""The model runner's CUDA path: batched host->device inputs, CUDA graphs for decode, greedy on the GPU.

ModelRunner delegates `execute` here on CUDA. What it does differently from the CPU path:
- Inputs are built with numpy per request (never per token) into one pinned int64 staging buffer
  (host_batch.HostBatch, the CPU path's builder too) and move in one host->device copy per step.
- Pure decode steps of up to `max_num_seqs` (at most 256) sequences replay a CUDA graph captured for the
  next larger batch size; padding rows carry seq_len 0 (attention writes zeros) and slot -1 (no K/V
  store). The graph holds the whole model, the lm_head and the greedy argmax. Block tables live on the
  device as one persistent row per request; a step sends only the blocks added since the last one.
- Greedy requests (no logprobs, min_tokens reached, no penalty, logit_bias or allowed_token_ids) are
  sampled by an argmax on the GPU, one small device->host copy per step; anything else goes through the
  batched sampler on the device.
- No host sync inside the model: kernel grids come from host-known sizes, sequence lengths are read on
  the device.
- Async scheduling (`launch_decode` / `collect_decode`, driven by pdserve.engine.runner.async_decode): a decode graph
  step can be launched before the previous one's tokens reached the host, its input ids gathered on the device
  from the previous replay's argmax; the host reads a step's tokens from a pinned copy queued behind it.
- Speculative verify steps (K + 1 rows per request) replay graphs of their own, keyed by (batch bucket, K + 1),
  drafts padded to K (pdserve.engine.runner.verify_graphs); `execute_verify`.
- Tensor parallelism: rank 0 hands each step's staged host inputs to `step_sink` before running it; the
  other ranks `replay` them through the same device code (graph replay or eager), so every rank runs the
  same graph with the same inputs, collectives included. Only rank 0 samples.
- Layer-pipelined push (`execute(..., on_layer)`): a step with a push prefill runs eagerly and calls
  `on_layer(i)` on the host after launching layer i; the callback records a CUDA event there
  (pdserve/kv_transfer/layer_ready.py) that the push writer thread waits on, so the forward never syncs.
  Decode graphs never carry the callback: a decode starts on the push's completion notification.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine import prompt_logprobs
from pdserve.engine.request import Request
from pdserve.engine.runner.decode_fusions import decode_fusions_from_env
from pdserve.engine.runner.host_batch import BlockTableCache, EagerShape, HostBatch
from pdserve.engine.runner.sampler import Sampler
from pdserve.engine.runner.step_graphs import StepGraphs, capture_step_graphs, replay_step
from pdserve.engine.runner.step_timing import StepTiming
from pdserve.engine.runner.tp_messages import EagerStep, GraphStep, StepMessage
from pdserve.engine.runner.verify_graphs import VerifyGraphs, verify_graph_sizes, verify_graphs_from_env
from pdserve.model.decoder import DecoderLM
from pdserve.types.outputs import TokenLogprob

log = logging.getLogger("pdserve.engine")

# Batch sizes with a captured decode graph; a batch is padded up to the next one.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_sizes_for(max_num_seqs: int) -> list[int]:
    sizes = [s for s in GRAPH_BATCH_SIZES if s < max_num_seqs]
    sizes.append(max_num_seqs if max_num_seqs <= GRAPH_BATCH_SIZES[-1] else GRAPH_BATCH_SIZES[-1])
    return sorted(set(sizes))


def pick_graph_size(sizes: list[int], batch: int) -> int | None:
    for s in sizes:
        if s >= batch:
            return s
    return None


def greedy_on_device(reqs: list[Request]) -> bool:
    """True when the sampler would return exactly the argmax of the raw logits for every request (the
    graph's argmax sees no penalty, logit_bias or allowed_token_ids)."""
    return all(
        r.params.greedy and r.params.logprobs is None and len(r.output_token_ids) >= r.params.min_tokens
        and not r.params.adjusts_logits
        for r in reqs
    )


@dataclass
class LaunchedDecode:
    """A decode graph step launched without waiting for it (async scheduling). The next step may take its input
    ids from `tokens` on the device; the host reads `host_tokens` once `ready` has passed."""

    num_rows: int
    tokens: torch.Tensor  # the step's argmax ids on the device ([>= num_rows], int64; the graph's output)
    host_tokens: torch.Tensor  # pinned host copy of tokens[:num_rows], filled by a copy queued behind the step
    ready: torch.cuda.Event | None  # recorded after that copy (None on CPU, where the copy is done at once)
    wait_s: float = 0.0  # host time spent waiting for it (collect_decode)


class GpuStepRunner:
    def __init__(self, model: DecoderLM, kv_pool: torch.Tensor, backend: AttentionBackend, sampler: Sampler, *,
                 block_size: int, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
                 simulate_graphs: bool = False, num_spec_tokens: int = 0):
        """The model, its paged KV pool (block-contiguous, on the device the steps run on), the attention
        backend and the sampler are the model runner's; the rest sizes the graphs and block tables.
        simulate_graphs (tests on CPU): run the decode-graph path's static buffers and padding eagerly
        instead of capturing, so its input handling is checked where no CUDA exists. num_spec_tokens: K of
        speculative decoding (0: none), for the verify graphs."""
        self.simulate_graphs = simulate_graphs
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.sampler = sampler
        self.device = kv_pool.device
        self.pin = self.device.type == "cuda"
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        if getattr(self.backend, "name", "") in ("triton", "flashinfer"):  # both store K/V with Triton
            from pdserve.engine.runner import gpu_ops as ops  # triton kernels; only ever imported on CUDA

            kv_format = getattr(self.backend, "kv_format", None)  # an fp8 pool: the K/V store quantizes
            self.model.fused_ops = ops if kv_format is None else ops.Fp8KvOps(kv_format)
            if self.device.type == "cuda" and decode_fusions_from_env():
                self.model.rope_table_len = max_model_len  # RoPE rows gathered: fewer graph nodes (issue 21)
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
        self.max_model_len = max_model_len
        self.timing = StepTiming()
        self.tables = BlockTableCache()
        self.step_sink: Callable[[StepMessage], None] | None = None  # rank 0 of a TP group: the other ranks' inputs
        # eager-step staging: grown on demand (a prefill step's size depends on the token budget)
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=self.device)
        self.graph_sizes: list[int] = []
        self.graphs: StepGraphs = {}
        self.num_spec_tokens = num_spec_tokens
        self.verify: VerifyGraphs | None = None  # the verify steps' graphs (None: verify steps run eagerly)
        self.verify_graphs_on = True  # switched off at run time by benchmarks (A/B against the eager step)
        # async scheduling: two pinned token buffers used in turn (a step's copy lands in one while the host
        # reads the previous step's from the other), and the event after the last launch's host->device
        # copies (the pinned staging buffers must not be rewritten before those copies ran)
        self._tok_host = [torch.zeros(max(max_num_seqs, 1), dtype=torch.int64, pin_memory=self.pin)
                          for _ in range(2)]
        self._tok_turn = 0
        self._staged: torch.cuda.Event | None = None
        # Graphs need a backend that reads sequence lengths on the device (the captured metadata's host
        # lists are placeholders); the torch reference reads host lists except in its decode path, which the
        # graphs' decode-only metadata takes, so it simulates them (tests) but is never captured.
        if simulate_graphs or (not enforce_eager and getattr(self.backend, "name", "") != "torch-sdpa"):
            self.graph_sizes = graph_sizes_for(max_num_seqs)
            self._capture()

    # ---- staging -------------------------------------------------------------------------------
    def _staging(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host.shape[0] < size:
            cap = max(size, 2 * self._host.shape[0], 1 << 16)
            self._host = torch.empty(cap, dtype=torch.int64, pin_memory=self.pin)
            self._dev = torch.empty(cap, dtype=torch.int64, device=self.device)
        return self._host, self._dev

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def _capture(self) -> None:
        bmax = self.graph_sizes[-1]
        self._gb = bmax
        width = self.max_blocks_per_seq
        # Static header, one host->device copy per step: ids | positions | slots | seq_lens | table rows |
        # source rows (async scheduling: which row of the previous step's tokens each row's input id is).
        self._g_host = torch.zeros(6 * bmax, dtype=torch.int64, pin_memory=self.pin)
        self._g_host_np = self._g_host.numpy()
        self._g_dev = torch.zeros(6 * bmax, dtype=torch.int64, device=self.device)
        # Persistent block tables: each request keeps one row while it lives, and a step sends only the
        # blocks added since the last (one in block_size steps per request). Row 0 stays zero, for the
        # padding rows. The graph gathers its batch's rows; rewriting [B, W] tables from Python lists each
        # step cost ~8 us per request on the H200 machine's CPU (~0.6 ms at batch 64).
        self._num_rows = self.max_num_seqs + 64
        self._g_rows = torch.zeros((self._num_rows + 1, width), dtype=torch.int64, device=self.device)
        self._row_of: dict[str, list] = {}  # request id -> [request, its block list, blocks written, row]
        self._free_rows = list(range(self._num_rows, 0, -1))
        self._g_qsl = torch.arange(bmax + 1, dtype=torch.int64, device=self.device)
        self._g_host_np[2 * bmax : 3 * bmax] = -1  # padding rows: no K/V store
        self._g_dev.copy_(self._g_host)
        # verify graphs: K > 0, a backend whose attention takes verify_rows, one rank (the other ranks of a
        # tensor-parallel group capture only the decode graphs: their captures' collectives must pair up)
        if (self.num_spec_tokens > 0 and verify_graphs_from_env() and self.model.tp is None
                and getattr(self.backend, "supports_verify_graphs", False)):
            self.verify = VerifyGraphs(self, self.num_spec_tokens, verify_graph_sizes(self.graph_sizes))
        if self.simulate_graphs:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.graphs = capture_step_graphs(self._graph_forward, self.graph_sizes, pool)
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.graphs), self.graph_sizes,
                 time.perf_counter() - t0)
        if self.verify is not None and not self.verify.capture(pool):
            self.verify = None

    def _graph_forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._gb
        hdr = self._g_dev
        meta = AttentionMetadata(
            query_start_loc=self._g_qsl[: size + 1],
            seq_lens=hdr[3 * b : 3 * b + size],
            block_tables=self._g_rows.index_select(0, hdr[4 * b : 4 * b + size]),
            slot_mapping=hdr[2 * b : 2 * b + size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_only=True,
            # placeholders: a replay serves any lengths, and the GPU backends never read these
            query_lens_host=[1] * size,
            seq_lens_host=[self.max_model_len] * size,
        )
        hidden = self.model(hdr[0:size], hdr[b : b + size], self.kv_pool, meta, self.backend)
        return self.model.logits_and_greedy(hidden)

    def _free_stale_rows(self) -> None:
        """Rows of finished requests, or of preempted ones (their block list was replaced), go back."""
        for rid, ent in list(self._row_of.items()):
            req = ent[0]
            if req.finished or req.block_ids is not ent[1]:
                del self._row_of[rid]
                self._free_rows.append(ent[3])

    def _table_rows(self, batch: list[tuple[Request, int]]) -> tuple[list[int], list[int]] | None:
        """Each request's persistent row, and (flat index, block id) pairs for the blocks new since the
        last step. None when no row is free (more live requests than rows): the step runs eagerly."""
        width = self.max_blocks_per_seq
        rows: list[int] = []
        updates: list[int] = []
        row_of = self._row_of
        for req, _ in batch:
            lst = req.block_ids
            ent = row_of.get(req.request_id)
            n = len(lst)
            if ent is not None and ent[0] is req and ent[1] is lst:
                m = ent[2]
                if m < n:
                    base = ent[3] * width
                    for j in range(m, n):
                        updates += (base + j, lst[j])
                    ent[2] = n
                rows.append(ent[3])
                continue
            if ent is None:
                if not self._free_rows:
                    self._free_stale_rows()
                    if not self._free_rows:
                        return None
                row = self._free_rows.pop()
                ent = row_of[req.request_id] = [req, lst, 0, row]
            else:  # preempted and re-admitted (a new block list), or a new request reusing an id: same row
                ent[0] = req
                ent[1] = lst
            base = ent[3] * width
            for j in range(n):
                updates += (base + j, lst[j])
            ent[2] = n
            rows.append(ent[3])
        return rows, updates

    def _run_graph(self, batch: list[tuple[Request, int]],
                   size: int) -> tuple[torch.Tensor, torch.Tensor, list[int] | None] | None:
        """Replays the decode graph for a batch of one-token rows. Returns logits and argmax tokens for
        the batch's rows, and the rows that reach their frontier (None: all of them; a one-token chunk
        of a recompute after preemption does not)."""
        bs = self.block_size
        n = len(batch)
        got = self._table_rows(batch)
        if got is None:
            return None
        rows, updates = got
        # per-request Python values gathered in lists, stored with one numpy assignment each
        tok_l: list[int] = []
        pos_l: list[int] = []
        slot_l: list[int] = []
        partial: list[int] = []
        for i, (req, _) in enumerate(batch):
            p = req.num_computed_tokens
            tok_l.append(req.token_at(p))
            pos_l.append(p)
            slot_l.append(req.block_ids[p // bs] * bs + p % bs)
            if p + 1 != req.num_tokens:
                partial.append(i)
        self._wait_staged()
        self._stage_header(size, tok_l, pos_l, slot_l, rows)
        if self.step_sink is not None:
            self.step_sink(GraphStep(size, self._g_host_np.copy(), updates))
        logits, tokens = self._replay_graph(size, updates)
        keep = None
        if partial:
            skip = set(partial)
            keep = [i for i in range(n) if i not in skip]
        return logits[:n], tokens[:n], keep

    def _stage_header(self, size: int, tok_l: list[int], pos_l: list[int], slot_l: list[int],
                      rows: list[int], src_rows: list[int] | None = None) -> None:
        """Writes the pinned header for a graph step of len(pos_l) rows padded to `size`."""
        b = self._gb
        n = len(pos_l)
        buf = self._g_host_np
        buf[0:n] = tok_l
        buf[b : b + n] = pos_l
        buf[2 * b : 2 * b + n] = slot_l
        buf[3 * b : 3 * b + n] = buf[b : b + n] + 1
        buf[4 * b : 4 * b + n] = rows
        # padding rows up to the graph's size: no keys, no K/V store, the all-zero table row
        buf[n:size] = 0
        buf[b + n : b + size] = 0
        buf[2 * b + n : 2 * b + size] = -1
        buf[3 * b + n : 3 * b + size] = 0
        buf[4 * b + n : 4 * b + size] = 0
        if src_rows is not None:
            buf[5 * b : 5 * b + n] = src_rows

    def _write_table_updates(self, updates: list[int]) -> None:
        """New block-table entries ((flat index, block id) pairs, `_table_rows`) into the persistent rows."""
        if updates:
            m = len(updates) // 2
            host, dev = self._staging(2 * m)
            host.numpy()[: 2 * m] = updates
            dev[: 2 * m].copy_(host[: 2 * m], non_blocking=True)
            pairs = dev[: 2 * m].view(m, 2)
            self._g_rows.view(-1).index_copy_(0, pairs[:, 0], pairs[:, 1])

    def _wait_staged(self) -> None:
        """Before the pinned staging buffers are rewritten: the last async launch's host->device copies of
        them must have run (a launch does not wait for its step; the copies sit ahead of it in the stream)."""
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None

    def _replay_graph(self, size: int, updates: list[int], ids_from: tuple[torch.Tensor, int] | None = None,
                      ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The device half of a graph step, from the staged header (`_g_host`) and new block-table entries.
        ids_from (async scheduling): (the previous step's tokens on the device, n): the first n input ids are
        gathered from them by the header's source rows instead of coming from the host. ahead: launched
        without waiting for it (async scheduling)."""
        self._g_dev.copy_(self._g_host, non_blocking=True)
        self._write_table_updates(updates)
        if ids_from is not None:
            prev, n = ids_from
            b = self._gb
            torch.index_select(prev, 0, self._g_dev[5 * b : 5 * b + n], out=self._g_dev[0:n])
        if ahead and self.device.type == "cuda":
            # this launch does not wait for its step: the staging buffers may be rewritten once the copies
            # above ran, which the next launch checks (_wait_staged)
            self._staged = torch.cuda.Event()
            self._staged.record()
        return replay_step(self.graphs, size, self._graph_forward, self.simulate_graphs, self.timing)

    # ---- async scheduling ----------------------------------------------------------------------
    @property
    def can_launch_async(self) -> bool:
        """Decode steps can be launched ahead (graphs, or their CPU simulation; one rank: the other ranks'
        replays would need the previous step's tokens too)."""
        return (bool(self.graphs) or self.simulate_graphs) and self.step_sink is None

    @torch.inference_mode()
    def launch_decode(self, reqs: list[Request], positions: list[int], prev: LaunchedDecode | None = None,
                      src_rows: list[int] | None = None) -> LaunchedDecode | None:
        """Launches one decode graph step without waiting for it: row i computes request i's token at
        positions[i] (its K/V stored there) and samples the next one by the graph's argmax. The input ids come
        from the host (each request's token at its position) or, with `prev`, from row src_rows[i] of prev's
        tokens on the device: the step can be queued before prev's tokens reached the host. The caller has
        allocated each request's block for its position. None when no graph fits or no block-table row is
        free (nothing was launched; the caller runs the step synchronously)."""
        t0 = time.perf_counter()
        n = len(reqs)
        size = pick_graph_size(self.graph_sizes, n) if self.can_launch_async else None
        if size is None:
            return None
        got = self._table_rows([(r, 1) for r in reqs])
        if got is None:
            return None
        rows, updates = got
        bs = self.block_size
        slot_l = [req.block_ids[p // bs] * bs + p % bs for req, p in zip(reqs, positions, strict=True)]
        tok_l = [0] * n if prev is not None else [r.token_at(p) for r, p in zip(reqs, positions, strict=True)]
        self._wait_staged()
        self._stage_header(size, tok_l, positions, slot_l, rows, src_rows)
        _, tokens = self._replay_graph(size, updates, None if prev is None else (prev.tokens, n), ahead=True)
        # the step's tokens to the host, queued behind it; two buffers in turn: the host may still be reading
        # the previous step's while this copy lands
        host = self._tok_host[self._tok_turn]
        self._tok_turn ^= 1
        host[:n].copy_(tokens[:n], non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.timing.graph_steps += 1
        self.timing.steps += 1
        self.tables.end_step()
        self.timing.total_s += time.perf_counter() - t0
        return LaunchedDecode(n, tokens, host, ready)

    def collect_decode(self, launched: LaunchedDecode) -> list[int]:
        """Waits for a launched step's tokens to reach the host; returns them, one per row."""
        t0 = time.perf_counter()
        if launched.ready is not None:
            launched.ready.synchronize()
        ids = launched.host_tokens[: launched.num_rows].tolist()
        dt = time.perf_counter() - t0
        launched.wait_s = dt
        self.timing.wait_s += dt
        self.timing.total_s += dt
        return ids

    # ---- eager steps ---------------------------------------------------------------------------
    def _run_eager(self, batch: list[tuple[Request, int]],
                   on_layer: Callable[[int], None] | None = None) -> tuple[HostBatch, torch.Tensor | None]:
        host, dev = self._staging(HostBatch.max_size_of(batch, self.block_size))
        hb = HostBatch(batch, self.block_size, host.numpy(), self.tables)
        shape = hb.shape()
        if self.step_sink is not None:
            self.step_sink(EagerStep(shape, host.numpy()[: hb.size].copy()))
        return hb, self._eager_device(shape, host, dev, on_layer)

    def _eager_device(self, hb: EagerShape, host: torch.Tensor, dev: torch.Tensor,
                      on_layer: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """The device half of an eager step: logits of the sampling rows (None when none samples).
        on_layer(i): called on the host once layer i's kernels are queued (not run: see the module doc)."""
        dev[: hb.size].copy_(host[: hb.size], non_blocking=True)
        meta = hb.attention_metadata(lambda name: hb.view(dev, name), self.block_size)
        hidden = self.model(hb.view(dev, "ids"), hb.view(dev, "positions"), self.kv_pool, meta, self.backend,
                            on_layer)
        if hb.num_rows == 0:
            return None
        return self.model.compute_logits(hidden[hb.view(dev, "sample_rows")])

    # ---- other tensor-parallel ranks -----------------------------------------------------------
    @torch.inference_mode()
    def replay(self, msg: GraphStep | EagerStep) -> None:
        """Runs a step rank 0 staged (`step_sink`'s message) on this rank's shard; nothing is sampled."""
        if isinstance(msg, GraphStep):
            self._g_host_np[:] = msg.header
            self._replay_graph(msg.size, msg.updates)
        else:
            host, dev = self._staging(msg.shape.size)
            host.numpy()[: msg.shape.size] = msg.buf
            self._eager_device(msg.shape, host, dev)
        if self.device.type == "cuda":
            # the pinned staging buffers are rewritten by the next message: the copies must be done
            torch.cuda.current_stream().synchronize()

    # ---- one step ------------------------------------------------------------------------------
    def execute_logits(self, batch: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor | None]:
        """An eager step returning the raw logits of its rows unsampled (ModelRunner.execute_logits)."""
        t0 = time.perf_counter()
        hb, logits = self._run_eager_sampling_rows(batch)
        self.tables.end_step()
        self.timing.steps += 1
        self.timing.total_s += time.perf_counter() - t0
        return hb.sampling, logits

    def execute_verify(self, batch: list[tuple[Request, int]],
                       ) -> tuple[list[Request], torch.Tensor | None, list[int] | None]:
        """A speculative verify step (ModelRunner.execute_verify): its requests, the raw logits of their rows
        (spec_decode.rows' layout) and, where the rejection sampler needs nothing but the raw argmax, those rows'
        argmax ids (else None). From a verify graph where the step fits one, else an eager step."""
        t0 = time.perf_counter()
        size = self.verify.fits(batch) if self.verify is not None and self.verify_graphs_on else None
        got = None
        if size is not None:
            assert self.verify is not None
            got = self.verify.run(batch, size, want_argmax=greedy_on_device([req for req, _ in batch]))
        if got is None:
            reqs, logits = self.execute_logits(batch)
            return reqs, logits, None
        self.tables.end_step()
        self.timing.graph_steps += 1
        self.timing.steps += 1
        self.timing.total_s += time.perf_counter() - t0
        return got

    @property
    def verify_graph_steps(self) -> int:
        """Verify steps replayed from a graph so far."""
        return 0 if self.verify is None else self.verify.steps

    @property
    def verify_graphs(self) -> list[int]:
        """The batch sizes with a verify graph (empty: verify steps run eagerly)."""
        return [] if self.verify is None else list(self.verify.sizes)

    def _run_eager_sampling_rows(self, batch: list[tuple[Request, int]], on_layer: Callable[[int], None] | None = None,
                                 ) -> tuple[HostBatch, torch.Tensor | None]:
        """An eager step's logits of its sampling rows: the prompt-logprob rows it also computed are
        recorded on their requests and cut off."""
        hb, logits = self._run_eager(batch, on_layer)
        return hb, hb.sampling_logits(logits)

    def execute(self, batch: list[tuple[Request, int]], on_layer: Callable[[int], None] | None = None,
                ) -> tuple[list[Request], list[int], list[TokenLogprob | None]]:
        """One step; on_layer (layer-pipelined push): the step runs eagerly and calls it after each layer."""
        t0 = time.perf_counter()
        size = None
        if (on_layer is None and (self.graphs or self.simulate_graphs) and all(n == 1 for _, n in batch)
                and not prompt_logprobs.prompt_spans(batch)):  # a graph computes only the sampling rows
            size = pick_graph_size(self.graph_sizes, len(batch))
        graph_out = self._run_graph(batch, size) if size is not None else None
        if graph_out is not None:
            logits, tokens, keep = graph_out
            if keep is None:
                sampling = [req for req, _ in batch]
            else:  # rare: rows that stop short of their frontier sample nothing
                sampling = [batch[i][0] for i in keep]
                idx = torch.tensor(keep, dtype=torch.int64).to(self.device, non_blocking=True)
                logits, tokens = logits[idx], tokens[idx]
            self.timing.graph_steps += 1
        else:
            hb, logits = self._run_eager_sampling_rows(batch, on_layer)
            sampling = hb.sampling
            tokens = None if logits is None else logits.argmax(dim=-1)
        result: tuple[list[Request], list[int], list[TokenLogprob | None]] = ([], [], [])
        if logits is not None and sampling:
            t1 = time.perf_counter()
            if greedy_on_device(sampling):
                assert tokens is not None
                ids = tokens.tolist()  # the step's one device->host copy, and its one sync
                lps: list[TokenLogprob | None] = [None] * len(sampling)
            else:
                ids, lps = self.sampler.sample(logits, sampling)
            self.timing.wait_s += time.perf_counter() - t1
            result = (sampling, ids, lps)
        else:
            t1 = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # keep the step synchronous, as the CPU path is
            self.timing.wait_s += time.perf_counter() - t1
        self.tables.end_step()
        self.timing.steps += 1
        self.timing.total_s += time.perf_counter() - t0
        return result
