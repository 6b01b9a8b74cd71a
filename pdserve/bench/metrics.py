"""Client-side serving metrics, computed exactly as `vllm bench serve` does (reference section 11.4).

* TTFT: send -> first token-bearing message; ITL: gaps between token-bearing messages (a multi-token
  chunk counts once); E2EL: send -> last token-bearing message.
* TPOT per request: (E2EL - TTFT) / (output_tokens - 1) when output_tokens > 1; such requests are
  left out of the TPOT statistics, and count as TPOT 0 for goodput.
* Aggregates in ms: numpy mean, median, population std and `np.percentile` (linear interpolation);
  an empty list reads as 0, as in vLLM (`np.mean(xs or 0)`).
* Goodput (DistServe): completed requests meeting every given SLO (`slo >= value`) per second of
  benchmark duration; failed requests are never good.
* Peak output tokens/s and peak concurrency come from 1-second buckets since the first start.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.types import RequestOutput

MS_PER_S = 1000.0
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"


@dataclass
class MetricStats:
    """mean / median / std and the selected percentiles of one metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    ttft: MetricStats
    tpot: MetricStats
    itl: MetricStats
    e2el: MetricStats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    good_completed: int = 0
    errors: list[str] = field(default_factory=list)
    # prompt tokens the server reported as not computed (prefix cache or offload tiers); None: never reported
    total_cached_input: int | None = None


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """Stats of a list of seconds, reported in ms, with vLLM's `or 0` convention for empty lists."""
    data: Sequence[float] | int = list(values_s) or 0
    return MetricStats(
        mean=float(np.mean(data)) * MS_PER_S,
        median=float(np.median(data)) * MS_PER_S,
        std=float(np.std(data)) * MS_PER_S,
        percentiles=[(float(p), float(np.percentile(data, p)) * MS_PER_S) for p in percentiles],
    )


def percentile_word(p: float) -> str:
    """`99` -> "99", `99.9` -> "99.9" (the key/label spelling vLLM uses)."""
    return str(int(p)) if int(p) == p else str(p)


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """Parse `ttft:2000 tpot:30 e2el:5000` (milliseconds) and validate names and values."""
    config: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            if not sep:
                raise ValueError(pair)
            number = float(value)
        except ValueError as err:
            raise ValueError(
                "Invalid format found for service level objectives. Specify service level objectives "
                'for goodput as "KEY:VALUE" pairs, where the key is a metric name, and the value is a '
                "number in milliseconds."
            ) from err
        if name not in GOODPUT_METRICS:
            raise ValueError(
                f"Invalid metric name found, {name}: {value}. The service level objective name should "
                f"be one of {list(GOODPUT_METRICS)}."
            )
        if number < 0 or math.isnan(number):
            raise ValueError(
                f"Invalid value found, {name}: {value}. The service level objective value should be "
                "non-negative."
            )
        config[name] = number
    return config


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    for p in values:
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentile {p} is outside [0, 100]")
    return values


def parse_percentile_metrics(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    for name in names:
        if name not in PERCENTILE_METRICS:
            raise ValueError(f"unknown percentile metric {name!r}; allowed: {', '.join(PERCENTILE_METRICS)}")
    return names


def peak_output_and_concurrency(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """Max output tokens in any 1 s bucket and max requests active in any 1 s bucket.

    Buckets start at the earliest start time of a successful request. A token lands at
    `start + ttft + cumsum(itl)`; a request is active in every bucket from its start to its end.
    """
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t_end = max(o.start_time + o.latency for o in ok)
    n_buckets = int(np.ceil(t_end - t0)) + 1
    tokens = np.zeros(n_buckets)
    concurrent = np.zeros(n_buckets)
    for o in ok:
        t = o.start_time + o.ttft
        token_times = [t]
        for gap in o.itl:
            t += gap
            token_times.append(t)
        for tt in token_times:
            bucket = int(tt - t0)
            if 0 <= bucket < n_buckets:
                tokens[bucket] += 1
        first = int(o.start_time - t0)
        last = int(o.start_time + o.latency - t0)
        for second in range(first, min(last, n_buckets - 1) + 1):
            concurrent[second] += 1
    return float(np.max(tokens)), int(np.max(concurrent))


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    dur_s: float,
    count_tokens: Callable[[str], int] | None,
    selected_percentiles: Sequence[float],
    goodput_config: dict[str, float],
) -> tuple[BenchmarkMetrics, list[int]]:
    """The aggregate metrics and the per-request output lengths (0 for failed requests).

    `count_tokens` re-tokenises the generated text when the server sent no usage; without it a
    request with no usage counts as 1 output token (vLLM's behaviour without a tokenizer).
    """
    actual_output_lens: list[int] = []
    total_input = 0
    total_cached: int | None = None
    completed = 0
    itls: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    ttfts: list[float] = []
    e2els: list[float] = []
    for out in outputs:
        if not out.success:
            actual_output_lens.append(0)
            continue
        output_len = out.output_tokens
        if not output_len:
            output_len = count_tokens(out.generated_text) if count_tokens is not None else 1
        actual_output_lens.append(output_len)
        total_input += out.prompt_len
        if out.cached_tokens is not None:
            total_cached = (total_cached or 0) + out.cached_tokens
        tpot = 0.0
        if output_len > 1:
            tpot = (out.latency - out.ttft) / (output_len - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(out.itl)
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1

    good_completed = 0
    if goodput_config:
        columns: list[list[float]] = []
        slos: list[float] = []
        for name, column in (("ttft", ttfts), ("tpot", all_tpots), ("e2el", e2els)):
            if name in goodput_config:
                columns.append(column)
                slos.append(goodput_config[name] / MS_PER_S)
        for row in zip(*columns, strict=True):
            if all(slo >= value for slo, value in zip(slos, row, strict=True)):
                good_completed += 1

    max_tok_s, max_conc = peak_output_and_concurrency(outputs)
    total_output = sum(actual_output_lens)
    metrics = BenchmarkMetrics(
        completed=completed,
        failed=sum(1 for o in outputs if not o.success),
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / dur_s,
        request_goodput=good_completed / dur_s,
        output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        ttft=summarize(ttfts, selected_percentiles),
        tpot=summarize(tpots, selected_percentiles),
        itl=summarize(itls, selected_percentiles),
        e2el=summarize(e2els, selected_percentiles),
        max_output_tokens_per_s=max_tok_s,
        max_concurrent_requests=max_conc,
        good_completed=good_completed,
        errors=[o.error for o in outputs if not o.success],
        total_cached_input=total_cached,
    )
    return metrics, actual_output_lens
