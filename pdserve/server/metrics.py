"""Prometheus metrics with vLLM's names, buckets and labels (`model_name`, `engine`).

Per-request histograms and counters are recorded by the HTTP side from the engine's timestamps; the
scheduler gauges and cumulative cache counters are read from `engine.stats()` at scrape time. Everything
lives on one registry per server, which the KV connector also registers its `vllm:nixl_*` metrics on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], Any], labels: dict[str, str]):
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        s = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("pdserve:num_requests_awaiting_kv_params",
                    "Decode legs sent ahead of their prefill, waiting for their kv_transfer_params.",
                    getattr(s, "num_awaiting_params", 0))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.num_preemptions)
        tiers = getattr(s, "kv_tiers", None)
        if tiers is not None:  # the offload tiers play vLLM's external (connector) prefix cache
            yield counter("vllm:external_prefix_cache_queries",
                          "External prefix cache queries, in terms of number of queried tokens.",
                          s.external_prefix_cache_queries)
            yield counter("vllm:external_prefix_cache_hits",
                          "External prefix cache hits, in terms of number of cached tokens.",
                          s.external_prefix_cache_hits)
            yield from _tier_metrics(tiers, names, values)
        spec = getattr(s, "spec_decode", None)
        if spec is not None:  # only with speculation on, as vLLM registers them
            yield from _spec_decode_metrics(spec, names, values)
        yield gauge("pdserve:num_requests_held", "Finished prefill legs whose KV blocks are held for a consumer.",
                    getattr(s, "num_held", 0))


def _spec_decode_metrics(spec: Any, names: list[str], values: list[str]) -> Iterator[Metric]:
    """vLLM's speculative decoding counters (vllm/v1/spec_decode/metrics.py, SpecDecodingProm); acceptance
    rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts."""
    for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                     ("num_draft_tokens", "Number of draft tokens."),
                     ("num_accepted_tokens", "Number of accepted tokens.")):
        c = CounterMetricFamily(f"vllm:spec_decode_{key}", doc, labels=names)
        c.add_metric(values, getattr(spec, key))
        yield c
    c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                            labels=[*names, "position"])
    for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
        c.add_metric([*values, str(pos)], n)
    yield c


_TIER_COUNTERS = (
    ("query_tokens", "pdserve:kv_tier_queries", "Prompt tokens looked up in this KV offload tier."),
    ("hit_tokens", "pdserve:kv_tier_hits", "Prompt tokens this KV offload tier supplied (hit rate: hits/queries)."),
    ("offload_bytes", "pdserve:kv_tier_offload_bytes", "Bytes of KV blocks stored into this tier."),
    ("offload_seconds", "pdserve:kv_tier_offload_seconds", "Seconds spent storing KV blocks into this tier."),
    ("load_bytes", "pdserve:kv_tier_load_bytes", "Bytes of KV blocks loaded from this tier into the KV pool."),
    ("load_seconds", "pdserve:kv_tier_load_seconds", "Seconds spent loading KV blocks from this tier."),
)


def _tier_metrics(tiers: dict[str, dict[str, float]], names: list[str], values: list[str]) -> Iterator[Metric]:
    """Per offload tier (label `medium`: CPU = host memory, DISK), from EngineStats.kv_tiers."""
    labels = [*names, "medium"]
    for key, name, doc in _TIER_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=labels)
        for medium, row in tiers.items():
            c.add_metric([*values, medium], row[key])
        yield c
    g = GaugeMetricFamily("pdserve:kv_tier_usage_perc", "KV offload tier usage. 1 means 100 percent usage.",
                          labels=labels)
    for medium, row in tiers.items():
        g.add_metric([*values, medium], row["blocks"] / max(row["capacity_blocks"], 1))
    yield g
    disk = tiers.get("DISK")
    if disk is not None:
        c = CounterMetricFamily("pdserve:kv_tier_corrupt_blocks",
                                "Disk-tier block files that failed verification (dropped and recomputed).",
                                labels=names)
        c.add_metric(values, disk.get("corrupt_blocks", 0))
        yield c
    host = tiers.get("CPU")
    if host is not None and "digest_mismatch_blocks" in host:
        c = CounterMetricFamily("pdserve:kv_tier_digest_mismatch_blocks",
                                "Host-tier blocks whose bytes no longer matched their digest (enable_kv_digest): "
                                "dropped and recomputed, never loaded.", labels=names)
        c.add_metric(values, host["digest_mismatch_blocks"])
        yield c


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], Any],
                 registry: CollectorRegistry | None = None, engine_label: str = "0"):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine_label}
        names = list(self.labels)
        reg = self.registry
        self.registry.register(_EngineStatsCollector(stats, self.labels))
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              names, buckets=TTFT_BUCKETS, registry=reg).labels(**self.labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             names, buckets=ITL_BUCKETS, registry=reg).labels(**self.labels)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", names,
                              buckets=ITL_BUCKETS, registry=reg).labels(**self.labels)

        def latency(name: str, doc: str) -> Any:
            return Histogram(name, doc, names, buckets=LATENCY_BUCKETS, registry=reg).labels(**self.labels)

        self.e2e = latency("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.queue = latency("vllm:request_queue_time_seconds",
                             "Histogram of time spent in WAITING phase for request.")
        self.inference = latency("vllm:request_inference_time_seconds",
                                 "Histogram of time spent in RUNNING phase for request.")
        self.prefill = latency("vllm:request_prefill_time_seconds",
                               "Histogram of time spent in PREFILL phase for request.")
        self.decode = latency("vllm:request_decode_time_seconds",
                              "Histogram of time spent in DECODE phase for request.")
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.req_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                           names, buckets=token_buckets, registry=reg).labels(**self.labels)
        self.req_gen_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        names, buckets=token_buckets, registry=reg).labels(**self.labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names,
                                     registry=reg).labels(**self.labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         names, registry=reg).labels(**self.labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=reg)
        self.success = {r: success.labels(**self.labels, finished_reason=r) for r in FINISH_REASONS}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestRecorder:
    """Per engine request: turns the engine's timestamps into observations (cheap, once per output)."""

    __slots__ = ("_m", "_arrival", "_last_token_time", "_first_seen")

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self._m = metrics
        self._arrival = arrival  # time.monotonic() when the HTTP request arrived
        self._last_token_time: float | None = None
        self._first_seen = False

    def on_output(self, out: Any) -> None:
        m = out.metrics
        if m is None or not out.new_token_ids:
            return
        n = len(out.new_token_ids)
        self._m.generation_tokens.inc(n)
        t = m.last_token_time
        if t is None:
            return
        if not self._first_seen:
            self._first_seen = True
            first = m.first_token_time if m.first_token_time is not None else t
            self._m.ttft.observe(max(first - min(self._arrival, m.arrival_time), 0.0))
            n -= 1  # tokens after the first in this delta share the gap to it
            self._last_token_time = first
        if n > 0 and self._last_token_time is not None:
            gap = max(t - self._last_token_time, 0.0) / n
            for _ in range(n):
                self._m.itl.observe(gap)
        self._last_token_time = t

    def on_finish(self, out: Any, finish_reason: str | None, num_prompt_tokens: int, num_output_tokens: int) -> None:
        mm = self._m
        mm.prompt_tokens.inc(num_prompt_tokens)
        mm.req_prompt_tokens.observe(num_prompt_tokens)
        mm.req_gen_tokens.observe(num_output_tokens)
        counter = mm.success.get(finish_reason or "abort")
        if counter is not None:
            counter.inc()
        m = out.metrics if out is not None else None
        if m is None:
            return
        end = m.finished_time or m.last_token_time
        if end is not None:
            mm.e2e.observe(max(end - min(self._arrival, m.arrival_time), 0.0))
        if m.first_scheduled_time is not None:
            mm.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            if m.last_token_time is not None:
                mm.inference.observe(max(m.last_token_time - m.first_scheduled_time, 0.0))
            if m.first_token_time is not None:
                mm.prefill.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
        if m.first_token_time is not None and m.last_token_time is not None:
            mm.decode.observe(max(m.last_token_time - m.first_token_time, 0.0))
            if num_output_tokens > 1:
                mm.tpot.observe((m.last_token_time - m.first_token_time) / (num_output_tokens - 1))
