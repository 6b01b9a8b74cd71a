"""Which rows of a step's flattened batch need logits: the last row of every request that reaches its
frontier, and for a request verifying drafts (`Request.spec_token_ids`) the row of each draft's position
too. The runners (CPU and GPU) share this, so both return the same rows in the same order."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.request import Request


def logit_rows(batch: Sequence[tuple[Request, int]]) -> tuple[list[int], list[Request]]:
    """(rows, requests): a request with k drafts owns k + 1 consecutive rows (the target's distribution
    after its last token and after each draft); any other request at its frontier owns one; a request
    mid-way through a chunked prefill owns none."""
    rows: list[int] = []
    reqs: list[Request] = []
    end = 0
    for req, n in batch:
        end += n
        k = len(req.spec_token_ids)
        if req.num_computed_tokens + n == req.num_tokens + k:
            rows.extend(range(end - 1 - k, end))
            reqs.append(req)
    return rows, reqs
