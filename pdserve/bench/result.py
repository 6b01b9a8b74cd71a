"""The printed result block and the JSON result, in `vllm bench serve`'s exact format and keys."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.bench.metrics import BenchmarkMetrics, MetricStats, percentile_word, summarize
from pdserve.bench.types import RequestOutput

if TYPE_CHECKING:
    from pdserve.bench.options import BenchSpec

# metric key -> (display name, section header)
METRIC_LABELS: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}
LATENCY_METRICS = ("ttft", "tpot", "itl")


def _int_row(label: str, value: int) -> str:
    return f"{label:<40} {value:<10}"


def _float_row(label: str, value: float) -> str:
    return f"{label:<40} {value:<10.2f}"


def metric_stats(
    name: str,
    metrics: BenchmarkMetrics,
    outputs: Sequence[RequestOutput],
    max_concurrency: int | None,
    request_rate: float,
    percentiles: Sequence[float],
) -> MetricStats | None:
    """Stats of one reportable metric; None when vLLM would not report it for this run."""
    if name in ("ttft", "tpot", "itl", "e2el"):
        return getattr(metrics, name)
    if max_concurrency is None:
        return None
    ok = [o for o in outputs if o.success]
    if name == "client_queue_time":
        return summarize([o.client_queue_time for o in ok], percentiles)
    if name == "e2el_including_client_queue" and not math.isinf(request_rate):
        return summarize([o.latency + o.client_queue_time for o in ok], percentiles)
    return None


def _reported(selected: Sequence[str], show_latency: bool) -> list[str]:
    order = [m for m in METRIC_LABELS if m in selected]
    return [m for m in order if show_latency or m not in LATENCY_METRICS]


def format_block(
    spec: BenchSpec,
    metrics: BenchmarkMetrics,
    duration: float,
    goodput: dict[str, float],
    selected: Sequence[str],
    percentiles: Sequence[float],
    outputs: Sequence[RequestOutput],
    show_latency: bool = True,
) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(_int_row("Successful requests:", metrics.completed))
    lines.append(_int_row("Failed requests:", metrics.failed))
    if spec.max_concurrency is not None:
        lines.append(_int_row("Maximum request concurrency:", spec.max_concurrency))
    if spec.request_rate != float("inf"):
        lines.append(_float_row("Request rate configured (RPS):", spec.request_rate))
    lines.append(_float_row("Benchmark duration (s):", duration))
    lines.append(_int_row("Total input tokens:", metrics.total_input))
    if metrics.total_cached_input is not None:  # what the server said it did not compute (any cache tier)
        lines.append(_int_row("Cached input tokens:", metrics.total_cached_input))
        lines.append(_int_row("Computed input tokens:", metrics.total_input - metrics.total_cached_input))
    if show_latency:
        lines.append(_int_row("Total generated tokens:", metrics.total_output))
    lines.append(_float_row("Request throughput (req/s):", metrics.request_throughput))
    if goodput:
        lines.append(_float_row("Request goodput (req/s):", metrics.request_goodput))
    if show_latency:
        lines.append(_float_row("Output token throughput (tok/s):", metrics.output_throughput))
        lines.append(_float_row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s))
    lines.append(_float_row("Peak concurrent requests:", metrics.max_concurrent_requests))
    if show_latency:
        lines.append(_float_row("Total token throughput (tok/s):", metrics.total_token_throughput))
    for name in _reported(selected, show_latency):
        stats = metric_stats(name, metrics, outputs, spec.max_concurrency, spec.request_rate, percentiles)
        if stats is None:
            continue
        label, header = METRIC_LABELS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_float_row(f"Mean {label} (ms):", stats.mean))
        lines.append(_float_row(f"Median {label} (ms):", stats.median))
        for p, value in stats.percentiles:
            lines.append(_float_row(f"P{percentile_word(p)} {label} (ms):", value))
    lines.append("=" * 50)
    return "\n".join(lines)


def build_result(
    spec: BenchSpec,
    outputs: Sequence[RequestOutput],
    output_lens: Sequence[int],
    metrics: BenchmarkMetrics,
    duration: float,
    goodput: dict[str, float],
    selected: Sequence[str],
    percentiles: Sequence[float],
    show_latency: bool = True,
) -> dict[str, Any]:
    """The run's keys of vLLM's result JSON (per-request arrays included; the caller may drop them)."""
    result: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_cached_input_tokens": metrics.total_cached_input,
        "cached_tokens": [o.cached_tokens for o in outputs],
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": list(output_lens),
        "ttfts": [o.ttft for o in outputs],
        "itls": [list(o.itl) for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "rtfx": 0.0,
    }
    for name in _reported(selected, show_latency):
        stats = metric_stats(name, metrics, outputs, spec.max_concurrency, spec.request_rate, percentiles)
        if stats is None:
            continue
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    return result
