"""Prometheus metrics of the proxy (one registry per proxy app, so several can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.proxy.kv_feed import RESYNC_KINDS
from pdserve.proxy.kv_routing import HIT, MISS, OUTCOMES
from pdserve.proxy.pool import Pool

if TYPE_CHECKING:
    from pdserve.proxy.kv_fleet import KVFleet

PATHS = ("disagg", "disagg_split", "conditional_local", "prefill_local", "collocated", "decode_local_fallback")
LEGS = ("prefill", "decode")
ERROR_KINDS = (
    "bad_request",
    "unauthorized",
    "overload",
    "prefill_connect",
    "prefill_timeout",
    "prefill_io",
    "prefill_status",
    "prefill_no_params",
    "prefill_failed",
    "decode_connect",
    "decode_timeout",
    "decode_io",
    "decode_status",
    "decode_stream",
    "no_instance",
    "no_pair",
    "retry_budget",
    "client_disconnect",
)
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


PEER_PULL_OUTCOMES = ("pull", "recompute", "uncached", "refused", "failed")


class _PoolCollector(Collector):
    """Per-instance gauges and counters read from the pools at scrape time (so removed instances
    disappear from /metrics instead of lingering as stale label sets)."""

    def __init__(self, pools: Callable[[], list[Pool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["role", "url"]
        in_flight = GaugeMetricFamily(
            "pdserve_proxy_instance_in_flight", "Legs in flight to the instance", labels=labels
        )
        tokens = GaugeMetricFamily(
            "pdserve_proxy_instance_outstanding_tokens",
            "Estimated tokens of the legs in flight to the instance",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pdserve_proxy_instance_healthy",
            "1 when the instance is admitted, 0 when starting (not yet probed) or ejected",
            labels=labels,
        )
        requests = CounterMetricFamily(
            "pdserve_proxy_instance_requests", "Legs sent to the instance", labels=labels
        )
        failures = CounterMetricFamily(
            "pdserve_proxy_instance_failures", "Failed legs and probes of the instance", labels=labels
        )
        ejections = CounterMetricFamily(
            "pdserve_proxy_instance_ejections", "Times the instance was ejected", labels=labels
        )
        for pool in self._pools():
            for inst in pool.instances:
                values = [inst.role, inst.url]
                in_flight.add_metric(values, inst.in_flight)
                tokens.add_metric(values, inst.outstanding_tokens)
                healthy.add_metric(values, 1.0 if inst.healthy else 0.0)
                requests.add_metric(values, inst.requests_total)
                failures.add_metric(values, inst.failures_total)
                ejections.add_metric(values, inst.ejections_total)
        yield from (in_flight, tokens, healthy, requests, failures, ejections)


class _KVFleetCollector(Collector):
    """The fleet-wide KV index and its event feeds, read at scrape time."""

    def __init__(self, fleet: KVFleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        fleet = self._fleet
        stats = fleet.stats()
        yield GaugeMetricFamily("pdserve_proxy_kv_index_blocks", "Distinct KV block hashes in the fleet-wide index",
                                value=len(fleet.index))
        yield GaugeMetricFamily("pdserve_proxy_kv_index_entries",
                                "(block, instance) pairs in the fleet-wide index", value=fleet.index.entries)
        yield GaugeMetricFamily("pdserve_proxy_kv_publishers", "Instances whose KV events the proxy subscribes to",
                                value=fleet.publishers())
        yield CounterMetricFamily("pdserve_proxy_kv_events", "KV events received (BlockStored, BlockRemoved, "
                                  "AllBlocksCleared)", value=stats.get("events", 0))
        yield CounterMetricFamily("pdserve_proxy_kv_event_batches", "KV event batches applied to the index",
                                  value=stats.get("batches", 0))
        yield CounterMetricFamily("pdserve_proxy_kv_event_errors", "KV event batches or messages that could not "
                                  "be decoded (skipped)", value=stats.get("decode_errors", 0))
        resyncs = CounterMetricFamily(
            "pdserve_proxy_kv_resyncs",
            "Index resynchronisations of one instance: replay (a sequence gap filled from the replay endpoint), "
            "clear (a gap that could not be filled: its entries dropped), reset (its publisher disconnected), "
            "snapshot (a snapshot installed again after a gap, a new publisher identity or silence)",
            labels=["kind"])
        for kind in RESYNC_KINDS:
            resyncs.add_metric([kind], stats.get(f"resync_{kind}", 0))
        yield resyncs
        yield CounterMetricFamily("pdserve_proxy_kv_snapshots", "KV event snapshots installed in the index",
                                  value=stats.get("snapshots", 0))
        yield CounterMetricFamily("pdserve_proxy_kv_events_dropped", "Live KV event messages dropped on purpose "
                                  "(PDSERVE_CHAOS_KV_EVENTS_DROP fault injection)", value=stats.get("dropped", 0))


class ProxyMetrics:
    def __init__(self, pools: Callable[[], list[Pool]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.in_flight = Gauge("pdserve_proxy_in_flight", "Client requests in flight", registry=reg)
        paths = Counter("pdserve_proxy_requests", "Client requests by the path taken", ["path"], registry=reg)
        self.path = {p: paths.labels(p) for p in PATHS}
        retries = Counter("pdserve_proxy_retries", "Legs retried on another instance", ["leg"], registry=reg)
        self.retries = {leg: retries.labels(leg) for leg in LEGS}
        errors = Counter("pdserve_proxy_errors", "Errors by kind", ["kind"], registry=reg)
        self.errors = {kind: errors.labels(kind) for kind in ERROR_KINDS}
        self.early_decode_legs = Counter(
            "pdserve_proxy_early_decode_legs",
            "Decode legs sent with their prefill leg, their kv_transfer_params delivered after it",
            registry=reg,
        )
        self.prefill_seconds = Histogram(
            "pdserve_proxy_prefill_seconds",
            "Prefill leg latency (successful legs)",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.decode_ttfb_seconds = Histogram(
            "pdserve_proxy_decode_ttfb_seconds",
            "Decode leg: seconds from sending the request to its first body byte",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.request_seconds = Histogram(
            "pdserve_proxy_request_seconds",
            "Client request latency, arrival to last byte relayed",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        history = Counter(
            "pdserve_proxy_kv_history",
            "Turns of a conversation whose earlier turn's KV a decode instance held (bidirectional_kv_xfer), by "
            "what the proxy did: pull (the prefill reads it), p_cache (the prefill's own prefix cache should hold "
            "it), recompute (cheaper by the plan arithmetic), none (no held history found), remembered (a "
            "decode response's held history kept for the next turn)",
            ["choice"],
            registry=reg,
        )
        self.kv_history = {c: history.labels(c) for c in ("pull", "p_cache", "recompute", "none", "remembered")}
        peer = Counter(
            "pdserve_proxy_kv_peer_pulls",
            "Prefill legs for which a peer instance caching more of the prompt was asked to pin it, by outcome: "
            "pull (pinned; the prefill leg reads it), recompute (pinned, but cheaper to recompute by the plan "
            "arithmetic), uncached (the peer no longer had enough of it cached), refused (the peer pins nothing "
            "now: disabled or at its maximum), failed (no answer from the peer)",
            ["outcome"],
            registry=reg,
        )
        self.kv_peer_pulls = {c: peer.labels(c) for c in PEER_PULL_OUTCOMES}
        reg.register(_PoolCollector(pools))
        self.retry_budget_tokens = Gauge(
            "pdserve_proxy_retry_budget_tokens", "Retries the retry budget allows right now", registry=reg
        )

    def register_kv(self, fleet: KVFleet) -> None:
        reg = self.registry
        routed = Counter(
            "pdserve_proxy_kv_routed_requests",
            "Requests routed by cached prefix, by outcome: hit (sent to an instance holding at least "
            "--kv-hit-fraction of the longest prefix cached in the pool), miss (another held more), uncached (no "
            "instance held a block of it), unknown (no prompt token ids)",
            ["outcome"], registry=reg)
        self.kv_outcomes = {o: routed.labels(o) for o in OUTCOMES}
        self.kv_counts = dict.fromkeys(OUTCOMES, 0)
        self.kv_prompt_tokens = Counter("pdserve_proxy_kv_prompt_tokens", "Prompt tokens of requests routed by "
                                        "cached prefix", registry=reg)
        self.kv_cached_tokens = Counter("pdserve_proxy_kv_cached_tokens", "Of those, tokens the chosen instance "
                                        "held (per the index)", registry=reg)
        hit_rate = Gauge("pdserve_proxy_kv_routing_hit_rate", "hit / (hit + miss) since the proxy started",
                         registry=reg)
        hit_rate.set_function(self._hit_rate)
        reg.register(_KVFleetCollector(fleet))

    def _hit_rate(self) -> float:
        hits, misses = self.kv_counts[HIT], self.kv_counts[MISS]
        return hits / (hits + misses) if hits + misses else 0.0

    def kv_routed(self, outcome: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.kv_outcomes[outcome].inc()
        self.kv_counts[outcome] += 1
        self.kv_prompt_tokens.inc(prompt_tokens)
        self.kv_cached_tokens.inc(cached_tokens)

    def error(self, kind: str) -> None:
        self.errors[kind].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
