"""A simulated run's requests as `pdserve bench`'s per-request outputs, so that its report and its result JSON
are made by bench/metrics.py and bench/result.py themselves: a predicted table reads as a measured one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.bench.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    BenchmarkMetrics,
    calculate_metrics,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
)
from pdserve.bench.options import BenchSpec
from pdserve.bench.result import build_result, format_block
from pdserve.bench.runner import Target, finalize_result
from pdserve.bench.types import RequestOutput
from pdserve.sim.cluster import Tracked


def to_outputs(tracked: Sequence[Tracked]) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for t in tracked:
        job = t.job
        if t.error or not t.done or not t.token_times:
            outs.append(RequestOutput(success=False, prompt_len=job.prompt_len, start_time=job.arrival,
                                      error=t.error or "not finished when the simulation ended"))
            continue
        times = t.token_times
        outs.append(RequestOutput(
            success=True, latency=times[-1] - job.arrival, output_tokens=len(times), ttft=times[0] - job.arrival,
            itl=[b - a for a, b in zip(times, times[1:], strict=False)], prompt_len=job.prompt_len,
            cached_tokens=t.cached_tokens, start_time=job.arrival))
    return outs


def bench_result(spec: BenchSpec, tracked: Sequence[Tracked], model_id: str, label: str,
                 print_block: bool = True) -> tuple[dict[str, Any], BenchmarkMetrics]:
    """vLLM's result dict (as `pdserve bench serve` saves it) and the metrics, printing the result block."""
    outputs = to_outputs(tracked)
    goodput = parse_goodput(spec.goodput)
    percentiles = parse_percentiles(spec.metric_percentiles)
    selected = parse_percentile_metrics(spec.percentile_metrics or DEFAULT_PERCENTILE_METRICS)
    ends = [o.start_time + o.latency for o in outputs if o.success]
    duration = max(ends) if ends else 1e-9  # from the first dispatch (t = 0) to the last response
    metrics, output_lens = calculate_metrics(outputs, duration, None, percentiles, goodput)
    result = build_result(spec, outputs, output_lens, metrics, duration, goodput, selected, percentiles)
    if print_block:
        print(format_block(spec, metrics, duration, goodput, selected, percentiles, outputs))
    target = Target(f"sim:{label}", f"sim:{label}", model_id, None, None, None)
    return finalize_result(spec, target, result, "simulated"), metrics
