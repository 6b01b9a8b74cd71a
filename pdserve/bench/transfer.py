"""The KV transfer check of the go/no-go rule, read from a decode instance's Prometheus `/metrics`.

The seed's rule: before trusting a disaggregated benchmark, read what real transfers cost. We snapshot
`vllm:nixl_xfer_time_seconds` (histogram) and `vllm:nixl_num_failed_transfers` (counter) on the decode
instance(s) before and after a target's sweep and judge the difference: the check passes when transfers
happened, none failed, and the mean transfer time is under `--max-xfer-ms` ("hundreds of milliseconds
means fix the transport first"). The metrics are read as `pdserve preflight` reads them (pdserve/preflight/metrics.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import aiohttp

from pdserve.api import prometheus
from pdserve.preflight.metrics import EXPIRED, FAILED, XFER_TIME, NixlSnapshot, parse_nixl


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


def judge(delta: NixlSnapshot, max_avg_ms: float, urls: list[str]) -> TransferCheck:
    """Pass/fail from the metrics difference over a sweep."""
    if not delta.present:
        return TransferCheck("fail", "no vllm:nixl_* metrics at " + ", ".join(urls), urls)
    count = delta.counts.get(XFER_TIME, 0.0)
    n = int(round(count))
    failed = int(round(delta.counter(FAILED)))
    expired = int(round(delta.counter(EXPIRED)))
    avg_ms = delta.sums.get(XFER_TIME, 0.0) / count * 1000.0 if count > 0 else None
    p90 = histogram_quantile(0.9, delta.buckets.get(XFER_TIME, {}))
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


async def snapshot(urls: list[str]) -> NixlSnapshot:
    """Sum of the NIXL metrics of every decode instance URL (each read at URL/metrics)."""
    total = NixlSnapshot()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for url in urls:
            async with session.get(metrics_url(url)) as resp:
                resp.raise_for_status()
                total = total + parse_nixl(await resp.text())
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
