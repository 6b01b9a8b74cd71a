"""Where a push prefill's WRITE time goes (issue 41): the push writer thread's counters, on `/metrics`.

The GPU WRITE path measured 30x slower than a READ of the same bytes; these say whether the time is in the
number of descriptors (NIXL/UCX pay ~10 us each), in building or posting them on the host, in the writer
waiting for the forward's layers (CUDA events), or in the tail after the prefill finished (its last WRITEs
and the completion notification). Exposed as `pdserve:kv_push_writer_*` counters (cumulative since start;
benchmarks/bench_pd_push.py prints their deltas per request).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_DOCS = {
    "posts": "WRITEs posted (one NIXL transfer request each).",
    "posts_during_prefill": "WRITEs posted before the prefill finished (layer-pipelined).",
    "descriptors": "Descriptors in the posted WRITEs (NIXL/UCX cost ~10 us each over CUDA IPC).",
    "layers": "Layers summed over the WRITEs (one WRITE spans several layers of its blocks when whole-request, "
              "or when the writer merged layers that were ready).",
    "block_layers": "(block, layer) slabs written.",
    "bytes": "Bytes in the posted WRITEs.",
    "build_seconds": "Writer host time building descriptor arrays.",
    "post_seconds": "Writer host time inside NIXL's prepare + post of the WRITEs.",
    "ready_wait_seconds": "Writer time blocked waiting for a layer's K/V (the forward's CUDA event).",
    "ready_waits": "Layer waits that blocked (the writer was ahead of the GPU).",
    "writes_done": "WRITEs seen complete.",
    "write_seconds": "Sum over WRITEs of the time from post to seen complete.",
    "jobs_done": "Push jobs completed (notification sent).",
    "tail_seconds": "Sum over jobs of the time from the prefill finishing to the completion notification.",
}


@dataclass
class PushStatsSnapshot:
    posts: int = 0
    posts_during_prefill: int = 0
    descriptors: int = 0
    layers: int = 0
    block_layers: int = 0
    bytes: int = 0
    build_seconds: float = 0.0
    post_seconds: float = 0.0
    ready_wait_seconds: float = 0.0
    ready_waits: int = 0
    writes_done: int = 0
    write_seconds: float = 0.0
    jobs_done: int = 0
    tail_seconds: float = 0.0
    tail_max_seconds: float = 0.0


class PushStats:
    """Cumulative counters the push writer thread updates (thread-safe; `snapshot` for tests and /metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s = PushStatsSnapshot()

    def add_post(self, *, descriptors: int, layers: int, blocks: int, nbytes: int, build_s: float, post_s: float,
                 during_prefill: bool) -> None:
        with self._lock:
            s = self._s
            s.posts += 1
            s.posts_during_prefill += int(during_prefill)
            s.descriptors += descriptors
            s.layers += layers
            s.block_layers += blocks * layers
            s.bytes += nbytes
            s.build_seconds += build_s
            s.post_seconds += post_s

    def add_wait(self, waited_s: float) -> None:
        if waited_s > 0:
            with self._lock:
                self._s.ready_wait_seconds += waited_s
                self._s.ready_waits += 1

    def add_done(self, write_s: float) -> None:
        with self._lock:
            self._s.writes_done += 1
            self._s.write_seconds += write_s

    def add_job(self, tail_s: float) -> None:
        with self._lock:
            s = self._s
            s.jobs_done += 1
            s.tail_seconds += tail_s
            s.tail_max_seconds = max(s.tail_max_seconds, tail_s)

    def snapshot(self) -> PushStatsSnapshot:
        with self._lock:
            return PushStatsSnapshot(**asdict(self._s))


class PushStatsCollector(Collector):
    """`pdserve:kv_push_writer_*` on the connector's Prometheus registry, read at scrape time."""

    def __init__(self, stats: PushStats, labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snap = asdict(self._stats.snapshot())
        names, values = list(self._labels), list(self._labels.values())
        for field, doc in _DOCS.items():
            fam = CounterMetricFamily(f"pdserve:kv_push_writer_{field}", "Push mode, prefill side: " + doc,
                                      labels=names)
            fam.add_metric(values, float(snap[field]))
            yield fam
        gauge = GaugeMetricFamily("pdserve:kv_push_writer_tail_max_seconds",
                                  "Push mode, prefill side: the longest tail (prefill finished -> notification).",
                                  labels=names)
        gauge.add_metric(values, float(snap["tail_max_seconds"]))
        yield gauge
