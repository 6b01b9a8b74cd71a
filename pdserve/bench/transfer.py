"""The KV transfer check of the go/no-go rule, read from a decode instance's Prometheus `/metrics`.

The seed's rule: before trusting a disaggregated benchmark, read what real transfers cost. We snapshot
`vllm:nixl_xfer_time_seconds` (histogram) and `vllm:nixl_num_failed_transfers` (counter) on the decode
instance(s) before and after a target's sweep and judge the difference: the check passes when transfers
happened, none failed, and the mean transfer time is under `--max-xfer-ms` ("hundreds of milliseconds
means fix the transport first").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import aiohttp

from pdserve.api import prometheus

XFER = "vllm:nixl_xfer_time_seconds"
FAILED = "vllm:nixl_num_failed_transfers"
EXPIRED = "vllm:nixl_num_kv_expired_reqs"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?\s*$")
_LE = re.compile(r'le="([^"]*)"')


@dataclass
class XferSnapshot:
    """Sums over all label sets of the NIXL metrics of one or more instances."""

    count: float = 0.0
    total_s: float = 0.0
    failed: float = 0.0
    expired: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound (s) -> cumulative count
    found: bool = False

    def __add__(self, other: XferSnapshot) -> XferSnapshot:
        buckets = dict(self.buckets)
        for le, c in other.buckets.items():
            buckets[le] = buckets.get(le, 0.0) + c
        return XferSnapshot(
            self.count + other.count,
            self.total_s + other.total_s,
            self.failed + other.failed,
            self.expired + other.expired,
            buckets,
            self.found or other.found,
        )

    def __sub__(self, other: XferSnapshot) -> XferSnapshot:
        buckets = {le: c - other.buckets.get(le, 0.0) for le, c in self.buckets.items()}
        return XferSnapshot(
            self.count - other.count,
            self.total_s - other.total_s,
            self.failed - other.failed,
            self.expired - other.expired,
            buckets,
            self.found,
        )


def parse_metrics(text: str) -> XferSnapshot:
    snap = XferSnapshot()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value_text = m.group(1), m.group(2) or "", m.group(3)
        try:
            value = float(value_text)
        except ValueError:
            continue
        if name == f"{XFER}_count":
            snap.count += value
            snap.found = True
        elif name == f"{XFER}_sum":
            snap.total_s += value
        elif name == f"{XFER}_bucket":
            le = _LE.search(labels)
            if le is not None:
                bound = float(le.group(1))  # "+Inf" parses as inf
                snap.buckets[bound] = snap.buckets.get(bound, 0.0) + value
        elif name in (FAILED, f"{FAILED}_total"):
            snap.failed += value
            snap.found = True
        elif name in (EXPIRED, f"{EXPIRED}_total"):
            snap.expired += value
    return snap


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' `histogram_quantile` over cumulative buckets (pdserve/api/prometheus.py); NaN if empty."""
    value = prometheus.histogram_quantile(q, buckets.items())
    return math.nan if value is None else value


@dataclass
class TransferCheck:
    status: str  # "pass" | "fail" | "not checked"
    detail: str
    urls: list[str] = field(default_factory=list)
    transfers: int = 0
    failed: int = 0
    expired: int = 0
    avg_ms: float | None = None
    p90_ms: float | None = None

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


NOT_CHECKED = TransferCheck("not checked", "no --transfer-check-url given for this target")


def judge(delta: XferSnapshot, max_avg_ms: float, urls: list[str]) -> TransferCheck:
    """Pass/fail from the metrics difference over a sweep."""
    if not delta.found:
        return TransferCheck("fail", "no vllm:nixl_* metrics at " + ", ".join(urls), urls)
    n = int(round(delta.count))
    failed = int(round(delta.failed))
    expired = int(round(delta.expired))
    avg_ms = delta.total_s / delta.count * 1000.0 if delta.count > 0 else None
    p90 = histogram_quantile(0.9, delta.buckets)
    p90_ms = None if math.isnan(p90) else p90 * 1000.0
    check = TransferCheck("pass", "", urls, n, failed, expired, avg_ms, p90_ms)
    if n <= 0:
        check.status, check.detail = (
            "fail",
            "no KV transfers recorded during the sweep (decode recomputed prompts?)",
        )
    elif failed > 0:
        check.status, check.detail = "fail", f"{failed} failed transfer(s) during the sweep"
    elif avg_ms is not None and avg_ms > max_avg_ms:
        check.status = "fail"
        check.detail = f"mean transfer time {avg_ms:.1f} ms > {max_avg_ms:g} ms: fix the transport first"
    else:
        check.detail = f"{n} transfers, mean {avg_ms:.2f} ms <= {max_avg_ms:g} ms, none failed"
    return check


async def snapshot(urls: list[str]) -> XferSnapshot:
    """Sum of the NIXL metrics of every decode instance URL (each read at URL/metrics)."""
    total = XferSnapshot()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for url in urls:
            async with session.get(metrics_url(url)) as resp:
                resp.raise_for_status()
                total = total + parse_metrics(await resp.text())
    return total


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    return url if url.endswith("/metrics") else f"{url}/metrics"


async def discover_decode_urls(proxy_url: str) -> list[str]:
    """Decode instance URLs from our proxy's `GET /pdserve/instances`."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(f"{proxy_url.rstrip('/')}/pdserve/instances") as resp,
    ):
        resp.raise_for_status()
        data = await resp.json(content_type=None)
    urls = [str(inst["url"]) for inst in data.get("decode", []) if isinstance(inst, dict) and inst.get("url")]
    if not urls:
        raise RuntimeError(f"{proxy_url}/pdserve/instances lists no decode instance")
    return urls
