"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of every prompt token given the tokens
before it, with the top n at each position.

A step's flattened batch holds, for a request in prefill, the chunk of positions [start, start + n); the
logits at position j predict token j + 1. So a chunk contributes the rows of positions j with j + 1 still a
prompt token (the last prompt position predicts the first output token: that is the sampling row). Chunked
prefill simply appends each chunk's share; the request's list starts as [None] (position 0 has nothing
before it), so its length says which position comes next, and a preempted request that recomputes its
prompt does not append twice. Such a request never starts from cached KV (BlockManager.find_cached_prefix),
since the skipped positions would have no logits.

The model runner computes these rows' logits in the same pass as the sampling rows: the rows' indices go
first in the step's row list, so tensor-parallel ranks, which replay the row list, gather the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.engine.runner.sampler import token_logprobs

# log_softmax over the vocabulary this many rows at a time: a long chunk's float32 copy stays bounded
_SLICE_ROWS = 512


@dataclass(frozen=True)
class PromptSpan:
    req: Request
    first_row: int  # the row of the step's flattened batch at position `first_pos`
    first_pos: int  # the prompt position whose logits come first (they predict token first_pos + 1)
    count: int


def prompt_spans(batch: list[tuple[Request, int]]) -> list[PromptSpan]:
    """The rows of this step whose logits give prompt logprobs, per request that asked for them."""
    spans: list[PromptSpan] = []
    offset = 0
    for req, n in batch:
        if req.params.prompt_logprobs is not None:
            start = req.num_computed_tokens
            first = max(start, len(req.prompt_logprobs) - 1)
            stop = min(start + n, req.num_prompt_tokens - 1)
            if stop > first:
                spans.append(PromptSpan(req, offset + first - start, first, stop - first))
        offset += n
    return spans


def span_rows(spans: list[PromptSpan]) -> list[int]:
    return [s.first_row + i for s in spans for i in range(s.count)]


def record(spans: list[PromptSpan], logits: torch.Tensor) -> None:
    """Appends each span's logprobs to its request; `logits` holds span_rows(spans)'s rows, in order."""
    row = 0
    for span in spans:
        req = span.req
        targets = req.prompt_token_ids[span.first_pos + 1 : span.first_pos + 1 + span.count]
        for lo in range(0, span.count, _SLICE_ROWS):
            hi = min(lo + _SLICE_ROWS, span.count)
            ids = torch.tensor(targets[lo:hi], dtype=torch.int64, device=logits.device)
            req.prompt_logprobs.extend(
                token_logprobs(logits[row + lo : row + hi], ids, [req.params.prompt_logprobs] * (hi - lo)))
        row += span.count
