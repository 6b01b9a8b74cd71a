"""KV transfer metrics of an instance: its Prometheus `vllm:nixl_*` series and its `KV Transfer metrics` log line.

Used by `pdserve preflight` (deltas around a few long prompts), `pdserve up --demo` (one request) and
`pdserve bench compare`'s transfer check (deltas over a target's sweep, summed over its decode instances).
Names as vLLM 0.33 exports them (reference: vllm-pd-protocol.md section 7).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

XFER_TIME = "vllm:nixl_xfer_time_seconds"
POST_TIME = "vllm:nixl_post_time_seconds"
BYTES = "vllm:nixl_bytes_transferred"
DESCRIPTORS = "vllm:nixl_num_descriptors"
FAILED = "vllm:nixl_num_failed_transfers"
FAILED_NOTIFS = "vllm:nixl_num_failed_notifications"
EXPIRED = "vllm:nixl_num_kv_expired_reqs"
NOTIFS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry"
COUNTERS = (FAILED, FAILED_NOTIFS, EXPIRED, NOTIFS_AFTER_EXPIRY)
HISTOGRAMS = (XFER_TIME, POST_TIME, BYTES, DESCRIPTORS)

LOG_MARKER = "KV Transfer metrics:"


@dataclass
class NixlSnapshot:
    """Sums over all label sets (engines) of one instance's nixl series (or, added up, of several instances');
    `present` = any nixl series seen."""

    present: bool = False
    sums: dict[str, float] = field(default_factory=dict)  # histogram -> _sum
    counts: dict[str, float] = field(default_factory=dict)  # histogram -> _count
    counters: dict[str, float] = field(default_factory=dict)  # counter name (without _total) -> value
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> {le: cumulative count}

    def delta(self, before: NixlSnapshot) -> NixlSnapshot:
        return NixlSnapshot(
            self.present,
            _minus(self.sums, before.sums),
            _minus(self.counts, before.counts),
            _minus(self.counters, before.counters),
            {h: _minus(b, before.buckets.get(h, {})) for h, b in self.buckets.items()},
        )

    def __add__(self, other: NixlSnapshot) -> NixlSnapshot:
        return NixlSnapshot(
            self.present or other.present,
            _plus(self.sums, other.sums),
            _plus(self.counts, other.counts),
            _plus(self.counters, other.counters),
            {h: _plus(self.buckets.get(h, {}), other.buckets.get(h, {})) for h in {*self.buckets, *other.buckets}},
        )

    @property
    def transfers(self) -> int:
        return int(self.counts.get(XFER_TIME, 0))

    @property
    def avg_xfer_s(self) -> float | None:
        n = self.counts.get(XFER_TIME, 0)
        return self.sums.get(XFER_TIME, 0.0) / n if n else None

    @property
    def avg_bytes(self) -> float | None:
        n = self.counts.get(BYTES, 0)
        return self.sums.get(BYTES, 0.0) / n if n else None

    def counter(self, name: str) -> float:
        return self.counters.get(name, 0.0)

    def summary_line(self) -> str:
        """The same keys as vLLM's `KV Transfer metrics` log line, computed from /metrics."""
        parts = [f"Num successful transfers={self.transfers}"]
        if self.avg_xfer_s is not None:
            parts.append(f"Avg xfer time (ms)={self.avg_xfer_s * 1e3:.3f}")
        n_post = self.counts.get(POST_TIME, 0)
        if n_post:
            parts.append(f"Avg post time (ms)={self.sums.get(POST_TIME, 0.0) / n_post * 1e3:.3f}")
        if self.avg_bytes is not None:
            parts.append(f"Avg MB per transfer={self.avg_bytes / 2**20:.3f}")
            t = self.sums.get(XFER_TIME, 0.0)
            if t > 0:
                parts.append(f"Throughput (MB/s)={self.sums.get(BYTES, 0.0) / 2**20 / t:.3f}")
        n_desc = self.counts.get(DESCRIPTORS, 0)
        if n_desc:
            parts.append(f"Avg number of descriptors={self.sums.get(DESCRIPTORS, 0.0) / n_desc:.1f}")
        parts.append(f"Num failed transfers={int(self.counter(FAILED))}")
        parts.append(f"Num KV expired reqs={int(self.counter(EXPIRED))}")
        return ", ".join(parts)


def _minus(after: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _plus(a: dict[Any, float], b: dict[Any, float]) -> dict[Any, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}


def parse_nixl(text: str) -> NixlSnapshot:
    """Parse Prometheus text exposition into a NixlSnapshot (other series are ignored)."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = NixlSnapshot()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:nixl_"):
            continue
        snap.present = True
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name.endswith("_sum") and name[:-4] in HISTOGRAMS:
                snap.sums[name[:-4]] = snap.sums.get(name[:-4], 0.0) + value
            elif name.endswith("_count") and name[:-6] in HISTOGRAMS:
                snap.counts[name[:-6]] = snap.counts.get(name[:-6], 0.0) + value
            elif name.endswith("_bucket") and name[:-7] in HISTOGRAMS and "le" in sample.labels:
                bucket = snap.buckets.setdefault(name[:-7], {})
                le = float(sample.labels["le"])  # "+Inf" parses as inf
                bucket[le] = bucket.get(le, 0.0) + value
            elif name.endswith("_total"):
                base = name[: -len("_total")]
                snap.counters[base] = snap.counters.get(base, 0.0) + value
            elif family.type in ("counter", "gauge", "unknown") and not name.endswith(("_created", "_bucket")):
                snap.counters[name] = snap.counters.get(name, 0.0) + value
    return snap


def scrape(client: httpx.Client, base_url: str) -> NixlSnapshot:
    r = client.get(base_url.rstrip("/") + "/metrics")
    r.raise_for_status()
    return parse_nixl(r.text)


_KV_RE = re.compile(r"([A-Za-z][A-Za-z ()/]*?)=([-+0-9.eE]+|nan|inf)")


def parse_log_line(line: str) -> dict[str, float]:
    """`... KV Transfer metrics: Num successful transfers=2, Avg xfer time (ms)=63.33, ...` -> {key: value}."""
    i = line.find(LOG_MARKER)
    if i < 0:
        return {}
    body = line[i + len(LOG_MARKER):]
    return {k.strip(): float(v) for k, v in _KV_RE.findall(body)}


def log_lines(path: Path, limit: int = 5) -> list[str]:
    """The last `limit` `KV Transfer metrics` lines of a log file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    found = [ln.rstrip() for ln in text.splitlines() if LOG_MARKER in ln]
    return found[-limit:]
