"""The per-run numbers compare mode tabulates, plots and judges (extracted from vLLM-format results)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


@dataclass
class RunSummary:
    target: str
    rate: float
    completed: int = 0
    failed: int = 0
    goodput: float = math.nan
    throughput: float = math.nan
    ttft_p50: float = math.nan
    ttft_p99: float = math.nan
    tpot_p50: float = math.nan
    tpot_p99: float = math.nan
    itl_p50: float = math.nan
    itl_p99: float = math.nan
    ttfts_ms: list[float] = field(default_factory=list)
    json_path: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.completed > 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = rate_label(self.rate)
        d.pop("ttfts_ms")
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _num(result: dict[str, Any], key: str) -> float:
    value = result.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def summarize_result(target: str, rate: float, result: dict[str, Any], json_path: str | None) -> RunSummary:
    """Pull the table's numbers out of a detailed vLLM-format result dict."""
    ttfts = result.get("ttfts") or []
    errors = result.get("errors") or [""] * len(ttfts)
    ok_ttfts = [t * 1000.0 for t, e in zip(ttfts, errors, strict=False) if not e]
    goodput = result.get("request_goodput")
    return RunSummary(
        target=target,
        rate=rate,
        completed=int(result.get("completed", 0)),
        failed=int(result.get("failed", 0)),
        goodput=float(goodput) if goodput is not None else math.nan,
        throughput=_num(result, "request_throughput"),
        ttft_p50=_num(result, "p50_ttft_ms"),
        ttft_p99=_num(result, "p99_ttft_ms"),
        tpot_p50=_num(result, "p50_tpot_ms"),
        tpot_p99=_num(result, "p99_tpot_ms"),
        itl_p50=_num(result, "p50_itl_ms"),
        itl_p99=_num(result, "p99_itl_ms"),
        ttfts_ms=ok_ttfts,
        json_path=json_path,
    )
