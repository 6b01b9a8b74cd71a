"""The speculative verify step in CUDA graphs (issue 42): one graph per (batch bucket, K + 1).

A verify step runs K + 1 query rows per request (its last token, then its drafts). Eager, the 8B model's
step costs 2.6-5.5x a graph-replayed plain step on the H200, all of it host launch time (BENCHMARKS.md,
"Speculative decoding"), so speculation cannot pay there. Here the step is captured like a decode step:
- Shapes are fixed per graph: B sequences x R = K + 1 rows. A request with k < K drafts (or none) is padded
  to R rows: the padded rows repeat its last real row's position, store no K/V (slot -1) and their logits
  are dropped, so they cannot change the accepted tokens (the real rows attend causally up to their own
  positions: a padded row sits after them). Uneven draft lengths therefore keep the graph (vLLM falls back
  to piecewise graphs for them, vllm#43114). Batch padding rows (seq_len 0) are those of the decode graphs.
- Attention is the split-KV decode kernel with the R rows of a sequence in one program
  (`triton_kernels.decode_attention(rows_per_seq=R)`, `AttentionMetadata.verify_rows`): the K/V are read once
  for all rows, as many programs as a plain step of B sequences; sequence lengths and row positions are read
  on the device, so one replay serves any lengths.
- The graph ends with the logits of every row and their argmax. When every request would be sampled by a
  plain argmax (`step_runner.greedy_on_device`), the host reads only the argmax ids (one small copy) and the
  rejection sampler takes them as the raw logits' argmax; otherwise it runs on the real rows' logits.
- Block tables are the decode graphs' persistent rows (`GpuStepRunner._table_rows`).
A step that does not fit (a prefill chunk in it, a request short of its frontier, prompt logprobs, more drafts
than K, more requests than the largest verify graph, tensor parallelism) runs the eager verify step, as does
everything when the capture failed (logged) or with `PDSERVE_SPEC_VERIFY_GRAPHS=0` (none captured; at run time
`GpuStepRunner.verify_graphs_on`, the benchmarks' A/B).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.engine import prompt_logprobs
from pdserve.engine.request import Request
from pdserve.engine.runner.step_graphs import StepGraphs, capture_step_graphs, replay_step

if TYPE_CHECKING:
    from pdserve.engine.runner.step_runner import GpuStepRunner

log = logging.getLogger("pdserve.engine")

VERIFY_GRAPHS_ENV = "PDSERVE_SPEC_VERIFY_GRAPHS"
# Largest batch with a verify graph: each graph keeps its own [B * (K + 1), vocab] float32 logits (~0.5 MB a row
# for a 128k vocabulary: 223 MB for the buckets up to 32 at K = 4); larger verify steps run eagerly.
VERIFY_MAX_BATCH = 32


def verify_graphs_from_env() -> bool:
    """False when PDSERVE_SPEC_VERIFY_GRAPHS=0: verify steps stay eager (A/B, or a workaround)."""
    return os.environ.get(VERIFY_GRAPHS_ENV, "1") != "0"


def verify_graph_sizes(graph_sizes: list[int], max_batch: int = VERIFY_MAX_BATCH) -> list[int]:
    """The decode graphs' batch buckets up to max_batch (the first bucket at least, so batch 1 always has one)."""
    sizes = [s for s in graph_sizes if s <= max_batch]
    return sizes or graph_sizes[:1]


class VerifyGraphs:
    """The verify graphs of one GpuStepRunner (whose model, pool, backend and block-table rows they use)."""

    def __init__(self, runner: GpuStepRunner, num_drafts: int, sizes: list[int]):
        self.runner = runner
        self.k = num_drafts
        self.rows = num_drafts + 1
        self.sizes = sizes
        self.graphs: StepGraphs = {}
        self.steps = 0  # verify steps replayed from a graph
        bmax = sizes[-1]
        self._b = bmax
        self._n = bmax * self.rows
        n, dev = self._n, runner.device
        # Static header, one host->device copy per step: ids [N] | positions [N] | slots [N] | seq_lens [B] |
        # block-table rows [B]. Rows past the step's stay as padding: slot -1, position 0, seq_len 0, row 0.
        self._host = torch.zeros(3 * n + 2 * bmax, dtype=torch.int64, pin_memory=runner.pin)
        self._host_np = self._host.numpy()
        self._host_np[2 * n : 3 * n] = -1
        self._dev = torch.zeros_like(self._host, device=dev)
        self._dev.copy_(self._host)
        self._qsl = torch.arange(bmax + 1, dtype=torch.int64, device=dev) * self.rows

    # ---- capture -------------------------------------------------------------------------------
    def capture(self, pool) -> bool:
        """Captures a graph per batch size (largest first, into the decode graphs' memory pool). On any failure
        nothing is kept and verify steps stay eager; returns whether graphs were captured."""
        t0 = time.perf_counter()
        try:
            self.graphs = capture_step_graphs(self.forward, self.sizes, pool)
        except Exception:  # noqa: BLE001 - any capture failure: the eager verify step is always correct
            log.warning("capturing the speculative verify CUDA graphs failed; verify steps run eagerly",
                        exc_info=True)
            self.graphs.clear()
            self.sizes = []
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a sticky CUDA error surfaces in the next step instead
                log.warning("CUDA synchronize after the failed capture failed", exc_info=True)
            return False
        log.info("captured %d speculative verify CUDA graphs (batch %s x %d rows) in %.1f s", len(self.graphs),
                 self.sizes, self.rows, time.perf_counter() - t0)
        return True

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's body for `size` sequences: (float32 logits [size * R, vocab], their argmax) from the
        device header."""
        r = self.runner
        n, b, rows = self._n, self._b, self.rows
        m = size * rows
        hdr = self._dev
        meta = AttentionMetadata(
            query_start_loc=self._qsl[: size + 1],
            seq_lens=hdr[3 * n : 3 * n + size],
            block_tables=r._g_rows.index_select(0, hdr[3 * n + b : 3 * n + b + size]),
            slot_mapping=hdr[2 * n : 2 * n + m],
            block_size=r.block_size,
            max_query_len=rows,
            max_seq_len=r.max_model_len,
            decode_only=False,
            # placeholders: a replay serves any lengths, and the backends that take verify_rows never read these
            query_lens_host=[rows] * size,
            seq_lens_host=[r.max_model_len] * size,
            verify_rows=rows,
            query_positions=hdr[n : n + m],
        )
        hidden = r.model(hdr[0:m], hdr[n : n + m], r.kv_pool, meta, r.backend)
        logits = r.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    # ---- one step ------------------------------------------------------------------------------
    def fits(self, batch: list[tuple[Request, int]]) -> int | None:
        """The graph size for this step, or None when it must run eagerly."""
        from pdserve.engine.runner.step_runner import pick_graph_size

        if not self.sizes or self.runner.step_sink is not None:
            return None
        for req, n in batch:
            k = len(req.spec_token_ids)
            # each request at its frontier with all of its drafts (a decode row, then k <= K drafts)
            if k > self.k or n != k + 1 or req.num_computed_tokens + n != req.num_tokens + k:
                return None
        if prompt_logprobs.prompt_spans(batch):
            return None
        return pick_graph_size(self.sizes, len(batch))

    def run(self, batch: list[tuple[Request, int]], size: int,
            want_argmax: bool) -> tuple[list[Request], torch.Tensor, list[int] | None] | None:
        """Replays the verify graph of `size` for the batch. Returns its requests, the logits of their real rows
        (k + 1 per request, in order: spec_decode.rows' layout) and, with want_argmax, those rows' argmax ids on
        the host. None when no block-table row is free (the caller runs the step eagerly)."""
        r = self.runner
        got = r._table_rows(batch)
        if got is None:
            return None
        table_rows, updates = got
        rows, n, bs = self.rows, self._n, r.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        real: list[int] = []  # the real rows' indices in the graph's rows
        for b, (req, q) in enumerate(batch):
            p = req.num_computed_tokens
            table = req.block_ids
            for i in range(q):
                t = p + i
                ids.append(req.token_at(t))
                pos.append(t)
                slots.append(table[t // bs] * bs + t % bs)
            last = p + q - 1
            pad = rows - q  # padded rows: the last real row's token and position, no K/V store
            ids += [ids[-1]] * pad
            pos += [last] * pad
            slots += [-1] * pad
            seq_lens.append(last + 1)
            real.extend(range(b * rows, b * rows + q))
        m = len(batch) * rows
        r._wait_staged()
        buf = self._host_np
        buf[0:m] = ids
        buf[n : n + m] = pos
        buf[2 * n : 2 * n + m] = slots
        buf[3 * n : 3 * n + len(batch)] = seq_lens
        buf[3 * n + self._b : 3 * n + self._b + len(batch)] = table_rows
        # rows and sequences of the graph past this batch: padding (their previous step's values cleared)
        end = size * rows
        buf[m:end] = 0
        buf[n + m : n + end] = 0
        buf[2 * n + m : 2 * n + end] = -1
        buf[3 * n + len(batch) : 3 * n + size] = 0
        buf[3 * n + self._b + len(batch) : 3 * n + self._b + size] = 0
        self._dev.copy_(self._host, non_blocking=True)
        r._write_table_updates(updates)
        logits, tokens = replay_step(self.graphs, size, self.forward, r.simulate_graphs, r.timing)
        self.steps += 1
        argmax = None
        if want_argmax:
            t = time.perf_counter()
            every = tokens[:m].tolist()  # the step's one device->host copy, and its one sync
            r.timing.wait_s += time.perf_counter() - t
            argmax = [every[j] for j in real]
        if len(real) == m:
            return [req for req, _ in batch], logits[:m], argmax
        idx = torch.tensor(real, dtype=torch.int64).to(r.device, non_blocking=True)
        return [req for req, _ in batch], logits.index_select(0, idx), argmax
