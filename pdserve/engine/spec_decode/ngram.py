"""Prompt lookup (vLLM's ngram proposer, vllm/v1/spec_decode/ngram_proposer.py): find the longest n-gram,
min_n <= n <= max_n, that ends the request's tokens and occurred earlier; propose the k tokens that
followed its earliest occurrence. Works where the answer copies its context: code edits, quotes."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for what follows `tokens` (1-D int array); [] when no n-gram matches."""
    total = tokens.shape[0]
    if k <= 0 or total < min_n + 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # occurrences starting at s with s + n <= total - 1: at least one token follows (the suffix itself,
        # s = total - n, is excluded; overlapping it is allowed, as in vLLM's KMP search)
        windows = sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n  # the earliest occurrence, as vLLM picks among equally long ones
            return tokens[start : start + k].tolist()
    return []
