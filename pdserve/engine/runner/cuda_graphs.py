"""Capturing a step's forward in CUDA graphs, one per batch size: the decode graphs (step_runner.py) and the
speculative verify graphs (verify_graphs.py) are captured the same way, into one memory pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# A captured graph with its static outputs: the logits and the argmax tokens a replay writes.
Captured = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]


def capture_graphs(forward: Callable[[int], tuple[torch.Tensor, torch.Tensor]], sizes: Sequence[int], pool: Any,
                   graphs: dict[int, Captured]) -> None:
    """Captures `forward(size)` for each batch size, largest first (the smaller ones reuse its memory in `pool`),
    into `graphs`. Each shape runs once before its capture, so that its kernels compile outside the graph."""
    with torch.inference_mode():
        for size in reversed(sizes):
            forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, tokens = forward(size)
            graphs[size] = (graph, logits, tokens)
    torch.cuda.synchronize()
