"""Compare-mode Markdown table and self-contained HTML report (plots embedded as base64 PNG)."""

from __future__ import annotations

import base64
import html
import math
import os
from collections.abc import Sequence
from typing import Any

from pdserve.bench.summary import RunSummary, rate_label
from pdserve.bench.transfer import TransferCheck
from pdserve.bench.verdict import RULE, Verdict

COLUMNS = [
    ("rate (req/s)", None),
    ("target", None),
    ("goodput (req/s)", "goodput"),
    ("req/s", "throughput"),
    ("p50 TTFT (ms)", "ttft_p50"),
    ("p99 TTFT (ms)", "ttft_p99"),
    ("p50 TPOT (ms)", "tpot_p50"),
    ("p99 TPOT (ms)", "tpot_p99"),
    ("p50 ITL (ms)", "itl_p50"),
    ("p99 ITL (ms)", "itl_p99"),
    ("ok/failed", None),
]
PLOT_TITLES = {
    "goodput_vs_rate": "Goodput vs request rate",
    "p99_itl_vs_rate": "p99 ITL vs request rate",
    "ttft_vs_rate": "TTFT p50/p99 vs request rate",
    "ttft_cdf": "TTFT CDF",
}


def _fmt(value: float, digits: int = 2) -> str:
    return (
        "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"
    )


def table_rows(runs: Sequence[RunSummary], targets: Sequence[str], rates: Sequence[float]) -> list[list[str]]:
    by_key = {(r.target, r.rate): r for r in runs}
    rows: list[list[str]] = []
    for rate in rates:
        for target in targets:
            run = by_key.get((target, rate))
            if run is None:
                continue
            if run.error is not None:
                rows.append(
                    [rate_label(rate), target] + ["n/a"] * 8 + [f"error: {run.error.splitlines()[0][:80]}"]
                )
                continue
            cells = [rate_label(rate), target]
            for _, attr in COLUMNS[2:-1]:
                cells.append(_fmt(getattr(run, attr), 3 if attr in ("goodput", "throughput") else 2))
            cells.append(f"{run.completed}/{run.failed}")
            rows.append(cells)
    return rows


def markdown_table(runs: Sequence[RunSummary], targets: Sequence[str], rates: Sequence[float]) -> str:
    header = [c for c, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in table_rows(runs, targets, rates):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines) + "\n"


def markdown_report(
    runs: Sequence[RunSummary],
    targets: Sequence[str],
    rates: Sequence[float],
    verdicts: Sequence[Verdict],
    workload: str,
) -> str:
    parts = [
        "# pdserve bench compare",
        "",
        workload,
        "",
        markdown_table(runs, targets, rates),
        "## Verdict",
        "",
        RULE,
        "",
    ]
    for v in verdicts:
        parts.append(f"**{v.candidate} vs {v.baseline}: {v.decision}**")
        parts.append("")
        parts.extend(f"- {reason}" for reason in v.reasons)
        parts.append("")
    return "\n".join(parts)


def _img(path: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return f'<img alt="{html.escape(os.path.basename(path))}" src="data:image/png;base64,{data}">'


def _transfer_html(check: TransferCheck | None) -> str:
    if check is None:
        return ""
    fields = [
        ("status", check.status),
        ("detail", check.detail),
        ("instances", ", ".join(check.urls) or "n/a"),
        ("transfers", str(check.transfers)),
        ("failed", str(check.failed)),
        ("expired leases", str(check.expired)),
        ("mean xfer (ms)", _fmt(check.avg_ms) if check.avg_ms is not None else "n/a"),
        ("p90 xfer (ms, from buckets)", _fmt(check.p90_ms) if check.p90_ms is not None else "n/a"),
    ]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in fields)
    return f"<table class=kv>{rows}</table>"


def html_report(
    runs: Sequence[RunSummary],
    targets: Sequence[str],
    rates: Sequence[float],
    verdicts: Sequence[Verdict],
    plots: dict[str, str],
    workload: str,
    config: dict[str, Any],
    generated: str,
) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c, _ in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>"
        for row in table_rows(runs, targets, rates)
    )
    verdict_html = []
    for v in verdicts:
        cls = "go" if v.decision.startswith("GO") else ("nogo" if v.decision == "NO-GO" else "undetermined")
        checks = "".join(
            f"<tr><td>{esc(rate_label(c.rate))}</td><td>{esc(_fmt(c.baseline_itl_p99))}</td>"
            f"<td>{'misses' if c.baseline_misses else 'meets'}</td><td>{c.baseline_goodput:.3f}</td>"
            f"<td>{c.candidate_goodput:.3f}</td><td>{'yes' if c.improves else 'no'}</td></tr>"
            for c in v.checks
        )
        slo = f"{v.itl_slo_ms:g} ms" if v.itl_slo_ms is not None else "none"
        verdict_html.append(
            f"<div class='verdict {cls}'><h3>{esc(v.candidate)} vs {esc(v.baseline)}: {esc(v.decision)}</h3>"
            f"<p>ITL target: {esc(slo)}</p><ul>"
            + "".join(f"<li>{esc(r)}</li>" for r in v.reasons)
            + "</ul>"
            + (
                "<table><tr><th>rate</th><th>baseline p99 ITL (ms)</th><th>baseline vs target</th>"
                "<th>baseline goodput</th><th>candidate goodput</th><th>improves</th></tr>"
                + checks
                + "</table>"
                if checks
                else ""
            )
            + "<h4>KV transfer check</h4>"
            + _transfer_html(v.transfer)
            + "</div>"
        )
    plot_html = "".join(
        f"<figure>{_img(path)}<figcaption>{esc(PLOT_TITLES.get(name, name))}</figcaption></figure>"
        for name, path in plots.items()
        if os.path.exists(path)
    )
    cfg_rows = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>" for k, v in config.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pdserve bench compare</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} table.kv th, table.kv td {{ text-align: left; }}
.verdict {{ border-left: 6px solid #999; padding: 0.3em 1em; margin: 1em 0; background: #fafafa; }}
.go {{ border-color: #2a9d3a; }} .nogo {{ border-color: #c0392b; }} .undetermined {{ border-color: #e0a800; }}
figure {{ display: inline-block; margin: 0.5em; }} img {{ max-width: 560px; }}
</style></head><body>
<h1>pdserve bench compare</h1>
<p>Generated {esc(generated)}. {esc(workload)}</p>
<h2>Verdict</h2>
<p><em>{esc(RULE)}</em></p>
{"".join(verdict_html)}
<h2>Results</h2>
<table><tr>{head}</tr>{body}</table>
<p>Goodput counts requests meeting every SLO per second of benchmark duration (vLLM/DistServe definition);
TPOT excludes the first token; ITL is the gap between streamed chunks; percentiles are numpy linear.</p>
<h2>Plots</h2>
{plot_html}
<h2>Configuration</h2>
<table class=kv>{cfg_rows}</table>
</body></html>
"""
