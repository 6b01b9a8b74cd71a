"""The flattened batch of one step: the one builder of the model runner's CPU path and its GPU step runner.

A step's scheduled (request, new tokens) pairs become its token ids, positions, KV slots, query starts,
sequence lengths, logit rows and block tables, written with numpy per request (never per token) into one
int64 buffer (HostBatch): pinned and copied to the device in one transfer on the GPU path
(pdserve.engine.runner.step_runner), made the CPU kernels' tensors on the CPU path (ModelRunner._prepare).
`EagerShape.attention_metadata` turns the buffer's segments into the step's AttentionMetadata on either path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.engine import prompt_logprobs
from pdserve.engine.request import Request
from pdserve.engine.spec_decode.rows import logit_rows


class BlockTableCache:
    """numpy copies of requests' block-id lists, extended as the lists grow.

    Converting every running request's Python list of block ids to numpy each step costs ~15 us per
    request at 1.5k context (~4 ms per step at batch 256, measured on the dev box), O(total blocks).
    The block manager only ever appends to `req.block_ids`, and replaces the list on release (preemption,
    finish), so a copy stays valid while the list object is the same: only its new tail is converted.
    A cheap guard (length, last cached element) rebuilds on anything else.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[list[int], np.ndarray, int, int]] = {}  # id -> (list, copy, n, seen)
        self._step = 0

    def get(self, req: Request) -> np.ndarray:
        lst = req.block_ids
        n = len(lst)
        ent = self._entries.get(req.request_id)
        if ent is not None and ent[0] is lst and ent[2] <= n and (ent[2] == 0 or ent[1][ent[2] - 1] == lst[ent[2] - 1]):
            arr, m = ent[1], ent[2]
            if m < n:
                if arr.shape[0] < n:
                    grown = np.empty(max(n, 2 * arr.shape[0]), dtype=np.int64)
                    grown[:m] = arr[:m]
                    arr = grown
                arr[m:n] = lst[m:n]
        else:
            arr = np.empty(max(n, 16), dtype=np.int64)
            arr[:n] = lst
        self._entries[req.request_id] = (lst, arr, n, self._step)
        return arr[:n]

    def end_step(self) -> None:
        """Forget requests not seen for a while (finished, aborted, or waiting after preemption)."""
        self._step += 1
        if self._step % 256 == 0:
            stale = self._step - 64
            for rid in [r for r, e in self._entries.items() if e[3] < stale]:
                del self._entries[rid]


def _align2(n: int) -> int:
    return (n + 1) & ~1


@dataclass(frozen=True)
class EagerShape:
    """What the device half of an eager step needs besides the staged buffer (also sent to other TP ranks)."""

    offsets: dict[str, tuple[int, int]]
    size: int
    num_seqs: int
    width: int
    query_lens: list[int]
    seq_lens: list[int]
    num_rows: int

    def view(self, buf, name: str):
        lo, hi = self.offsets[name]
        return buf[lo:hi]

    def attention_metadata(self, segment: Callable[[str], torch.Tensor], block_size: int) -> AttentionMetadata:
        """The step's attention metadata from its segments: `segment(name)` is the named segment as the backend
        takes it (views of the device copy on the GPU path; the CPU path's own tensors, its tables int32)."""
        return AttentionMetadata(
            query_start_loc=segment("query_start_loc"),
            seq_lens=segment("seq_lens"),
            block_tables=segment("block_tables").view(self.num_seqs, self.width),
            slot_mapping=segment("slots"),
            block_size=block_size,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            decode_only=all(q == 1 for q in self.query_lens),
            query_lens_host=self.query_lens,
            seq_lens_host=self.seq_lens,
        )


class HostBatch:
    """Flattened inputs for one step, built with numpy into a slice of an int64 buffer (pinned on the GPU path).

    Segments, each starting on a 16-byte boundary: ids[T] | positions[T] | slots[T] | query_start_loc[S+1] |
    seq_lens[S] | sample_rows[R] | block_tables[S, W]. Triton specialises pointer arguments on 16-byte
    alignment: segments at odd offsets would make each new parity mix of T, S and R compile another
    kernel variant mid-serving (~2 s each, measured on the H200 as mixed steps of 2 s)."""

    SEGMENTS = ("ids", "positions", "slots", "query_start_loc", "seq_lens", "sample_rows", "block_tables")

    def __init__(self, batch: list[tuple[Request, int]], block_size: int, buf: np.ndarray,
                 tables_cache: BlockTableCache | None = None, rows: list[int] | None = None):
        """rows: the rows whose logits the step computes; None: the prompt-logprob rows, then the sampling rows
        of the requests at their frontier. Given (a speculative draft model's step), no row samples here."""
        bs = block_size
        self.num_seqs = s = len(batch)
        self.num_tokens = t = sum(n for _, n in batch)
        self.width = w = max((r.num_computed_tokens + n + bs - 1) // bs for r, n in batch)
        self.query_lens = [n for _, n in batch]
        self.seq_lens = [r.num_computed_tokens + n for r, n in batch]
        self.prompt_spans: list[prompt_logprobs.PromptSpan] = []
        self.num_prompt_rows = 0
        self.sampling: list[Request] = []
        if rows is None:
            # prompt logprobs' rows first (pdserve.engine.prompt_logprobs), then the sampling rows (logit_rows)
            self.prompt_spans = prompt_logprobs.prompt_spans(batch)
            prompt_rows = prompt_logprobs.span_rows(self.prompt_spans)
            self.num_prompt_rows = len(prompt_rows)
            frontier_rows, self.sampling = logit_rows(batch)
            rows = prompt_rows + frontier_rows
        self.rows = rows
        self.num_rows = r = len(rows)
        self.offsets: dict[str, tuple[int, int]] = {}
        o = 0
        for name, length in zip(self.SEGMENTS, (t, t, t, s + 1, s, r, s * w), strict=True):
            self.offsets[name] = (o, o + length)
            o = _align2(o + length)
        self.size = o
        assert buf.shape[0] >= self.size
        ids, pos, slots, qsl, seql, sample_rows, flat_tables = (self.view(buf, name) for name in self.SEGMENTS)
        tables = flat_tables.reshape(s, w)
        sample_rows[:] = rows
        qsl[0] = 0
        qsl[1:] = np.cumsum(self.query_lens)
        seql[:] = self.seq_lens
        off = 0
        for i, (req, n) in enumerate(batch):
            start = req.num_computed_tokens
            stop = start + n
            prompt = req.prompt_token_ids
            if n == 1:
                ids[off] = req.token_at(start)
            elif stop <= len(prompt):
                ids[off : off + n] = prompt[start:stop]
            else:
                ids[off : off + n] = (req.token_ids() + req.spec_token_ids)[start:stop]
            nb = (stop + bs - 1) // bs
            if tables_cache is None:
                table = np.asarray(req.block_ids[:nb], dtype=np.int64)
            else:
                table = tables_cache.get(req)[:nb]
            tables[i, :nb] = table
            p = np.arange(start, stop, dtype=np.int64)
            pos[off : off + n] = p
            slots[off : off + n] = table[p // bs] * bs + p % bs
            off += n

    @staticmethod
    def max_size(num_tokens: int, num_seqs: int, width: int) -> int:
        """An upper bound on `size`: the logit rows are at most one per token plus one per sequence (prompt-logprob
        rows and the sampling rows may share a token), and each of the seven segments pads at most one element."""
        return 4 * num_tokens + 3 * num_seqs + 1 + num_seqs * width + 7

    @staticmethod
    def max_size_of(batch: list[tuple[Request, int]], block_size: int) -> int:
        """max_size for this batch: the buffer it needs."""
        width = max((r.num_computed_tokens + n + block_size - 1) // block_size for r, n in batch)
        return HostBatch.max_size(sum(n for _, n in batch), len(batch), width)

    def view(self, buf, name: str):
        """The named segment of `buf` (the host buffer or its device copy)."""
        lo, hi = self.offsets[name]
        return buf[lo:hi]

    def shape(self) -> EagerShape:
        return EagerShape(self.offsets, self.size, self.num_seqs, self.width, self.query_lens, self.seq_lens,
                          self.num_rows)

    def sampling_logits(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """From the logits of `rows`: the prompt-logprob rows' are recorded on their requests, the sampling rows'
        returned (None when no row samples)."""
        if logits is not None and self.prompt_spans:
            prompt_logprobs.record(self.prompt_spans, logits[: self.num_prompt_rows])
            logits = logits[self.num_prompt_rows :]
        return logits if self.sampling else None
