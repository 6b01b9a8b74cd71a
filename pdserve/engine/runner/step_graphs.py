"""CUDA graphs of one step function, one per batch size: the decode graphs (step_runner.py) and the speculative
verify graphs (verify_graphs.py) are captured and replayed the same way."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.runner.step_timing import StepTiming

StepForward = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # batch size -> (logits, tokens)
StepGraphs = dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]]  # batch size -> (graph, outputs)


def capture_step_graphs(forward: StepForward, sizes: list[int], pool: Any) -> StepGraphs:
    """A graph per batch size, largest first, into the memory pool `pool` (the smaller graphs reuse the largest's
    memory). Each shape's kernels are compiled by one eager forward outside its capture. Raises what the capture
    raises."""
    graphs: StepGraphs = {}
    with torch.inference_mode():
        for size in reversed(sizes):
            forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, tokens = forward(size)
            graphs[size] = (graph, logits, tokens)
    torch.cuda.synchronize()
    return graphs


def replay_step(graphs: StepGraphs, size: int, forward: StepForward, simulate: bool,
                timing: StepTiming) -> tuple[torch.Tensor, torch.Tensor]:
    """The (logits, tokens) of a step padded to `size` from its graph, the replay's host time counted in
    timing.launch_s; simulate (tests on CPU): `forward` run eagerly on the same static buffers instead."""
    if simulate:
        return forward(size)
    graph, logits, tokens = graphs[size]
    t = time.perf_counter()
    graph.replay()
    timing.launch_s += time.perf_counter() - t
    return logits, tokens
