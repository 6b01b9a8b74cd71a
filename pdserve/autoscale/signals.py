"""What the autoscaler measures: per-instance samples of `/metrics` and the proxy's in-flight legs, and
per-role numbers over a sliding window.

An instance sample holds the scheduler gauges (`vllm:num_requests_running`, `..._waiting`,
`vllm:kv_cache_usage_perc`, `pdserve:num_requests_held`) and the cumulative TTFT and ITL histograms
(`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`). A window keeps the samples of
the last `window_s` seconds; a role's signals are:

- `ongoing`: the proxy's legs in flight on the role's instances, summed, averaged over the window's ticks
  (Ray Serve's "ongoing requests");
- `waiting`: the engines' waiting queues, summed, averaged (for prefill: the prefill queue);
- `kv_usage`: the highest per-instance average KV-cache usage;
- `latency_q`: the q-quantile of the window's observations, from histogram bucket deltas with
  Prometheus' `histogram_quantile` interpolation: TTFT of prefill instances (queueing + prefill: the
  part of a client's TTFT that prefill replicas change), ITL of decode instances.

A counter that went down (the instance restarted) counts from zero, as Prometheus' rate() does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.api.prometheus import histogram_quantile

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "pdserve:num_requests_held": "held",
    # early decode legs parked for their params: a decode instance holding them is not idle, but they are
    # the prefill's queue, not the decode's (they must not make decode look short of replicas)
    "pdserve:num_requests_awaiting_kv_params": "awaiting_params",
}


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts: `buckets` = ((upper bound, count of observations <= it), ...), +Inf last."""

    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, before: Histogram | None) -> Histogram:
        """Observations since `before` (everything, if the instance restarted since: its counts went down)."""
        if before is None or not before.buckets or self.count < before.count:
            return self
        prev = dict(before.buckets)
        return Histogram(tuple((le, max(0.0, c - prev.get(le, 0.0))) for le, c in self.buckets))

    @staticmethod
    def merge(hists: Iterable[Histogram]) -> Histogram:
        total: dict[float, float] = {}
        for h in hists:
            for le, c in h.buckets:
                total[le] = total.get(le, 0.0) + c
        return Histogram(tuple(sorted(total.items())))

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile (pdserve/api/prometheus.py); None without observations."""
        return histogram_quantile(q, self.buckets)


@dataclass
class InstanceSample:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    held: float = 0.0
    awaiting_params: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)

    @property
    def idle(self) -> bool:
        """Nothing running, queued, awaiting its params or held for a consumer (safe to stop)."""
        return self.running == 0 and self.waiting == 0 and self.held == 0 and self.awaiting_params == 0


def parse_instance_metrics(text: str) -> InstanceSample:
    """An instance's Prometheus text -> its sample (sums over label sets; other series ignored)."""
    from prometheus_client.parser import text_string_to_metric_families

    sample = InstanceSample()
    buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    for family in text_string_to_metric_families(text):
        attr = GAUGES.get(family.name)
        if attr is not None:
            setattr(sample, attr, sum(float(s.value) for s in family.samples))
            continue
        if family.name in buckets:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[family.name][le] = buckets[family.name].get(le, 0.0) + float(s.value)
    sample.ttft = Histogram(tuple(sorted(buckets[TTFT].items())))
    sample.itl = Histogram(tuple(sorted(buckets[ITL].items())))
    return sample


@dataclass
class Tick:
    """One round of measurements: per instance URL its sample (None: scrape failed) and proxy legs."""

    t: float
    samples: dict[str, InstanceSample | None]
    in_flight: dict[str, int]


@dataclass(frozen=True)
class RoleSignals:
    replicas: int  # the controller's replicas of the role (starting and restarting ones included)
    serving: int  # of which answer and serve
    ongoing: float
    waiting: float
    kv_usage: float | None
    latency_q: float | None  # seconds (TTFT for prefill, ITL for decode); None without observations
    observations: int  # latency observations in the window

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "replicas": self.replicas, "serving": self.serving, "ongoing": round(self.ongoing, 3),
            "waiting": round(self.waiting, 3),
            "kv_usage": None if self.kv_usage is None else round(self.kv_usage, 4),
            "latency_q_ms": None if self.latency_q is None else round(self.latency_q * 1e3, 2),
            "observations": self.observations,
        }


class SignalWindow:
    """The ticks of the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._ticks: deque[Tick] = deque()

    def add(self, tick: Tick) -> None:
        self._ticks.append(tick)
        while len(self._ticks) > 2 and tick.t - self._ticks[1].t >= self.window_s:
            self._ticks.popleft()  # keep one tick at or before the window's start (the histogram baseline)

    def clear(self) -> None:
        self._ticks.clear()

    def signals(self, role: str, urls: Iterable[str], replicas: int, quantile: float) -> RoleSignals:
        urls = list(urls)
        ticks = list(self._ticks)
        if not ticks:
            return RoleSignals(replicas, 0, 0.0, 0.0, None, None, 0)
        recent = ticks[1:] if len(ticks) > 1 else ticks  # the ticks inside the window
        ongoing = _mean([sum(_ongoing(t, u) for u in urls) for t in recent]) or 0.0
        waiting = _mean([sum(s.waiting for u in urls if (s := t.samples.get(u)) is not None) for t in recent]) or 0.0
        kv = [m for u in urls if (m := _mean([s.kv_usage for t in recent if (s := t.samples.get(u)) is not None]))
              is not None]
        last = ticks[-1]
        serving = sum(1 for u in urls if last.samples.get(u) is not None)
        deltas = []
        for u in urls:
            seen = [s for t in ticks if (s := t.samples.get(u)) is not None]
            if len(seen) >= 2:  # one sample says nothing about the window: it needs a baseline
                before, now = seen[0], seen[-1]
                deltas.append(now.ttft.minus(before.ttft) if role == "prefill" else now.itl.minus(before.itl))
        merged = Histogram.merge(deltas)
        return RoleSignals(replicas, serving, ongoing, waiting, max(kv) if kv else None,
                           merged.quantile(quantile), int(merged.count))


def _ongoing(tick: Tick, url: str) -> float:
    """The proxy's legs in flight on `url`, less the early decode legs it parked there for their params: those
    wait for a prefill elsewhere and are prefill's load, not this instance's (counted, they made prefill-heavy
    load look like a shortage of decode replicas)."""
    sample = tick.samples.get(url)
    return max(0.0, tick.in_flight.get(url, 0) - (sample.awaiting_params if sample is not None else 0.0))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
