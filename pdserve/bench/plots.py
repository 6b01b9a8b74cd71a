"""Compare-mode PNG plots (matplotlib's Agg canvas; no pyplot global state)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.bench.summary import RunSummary, rate_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Figure, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _series(runs: Sequence[RunSummary], target: str, rates: Sequence[float], attr: str) -> list[float]:
    by_rate = {r.rate: r for r in runs if r.target == target}
    values = []
    for rate in rates:
        run = by_rate.get(rate)
        values.append(getattr(run, attr) if run is not None and run.ok else math.nan)
    return values


def _rate_axis(ax: Axes, rates: Sequence[float]) -> list[int]:
    xs = list(range(len(rates)))
    ax.set_xticks(xs)
    ax.set_xticklabels([rate_label(r) for r in rates])
    return xs


def plot_metric_vs_rate(
    runs: Sequence[RunSummary],
    targets: Sequence[str],
    rates: Sequence[float],
    attrs: Sequence[tuple[str, str]],
    title: str,
    ylabel: str,
    path: str,
    slo: float | None = None,
    slo_label: str = "target",
) -> str:
    """One line per (target, attr); `attrs` = [(RunSummary attribute, legend suffix)]."""
    fig, ax = _figure(title, "request rate (req/s)", ylabel)
    xs = _rate_axis(ax, rates)
    styles = ["-", "--", ":", "-."]
    for ti, target in enumerate(targets):
        color = f"C{ti % 10}"
        for ai, (attr, suffix) in enumerate(attrs):
            ys = _series(runs, target, rates, attr)
            label = f"{target} {suffix}".strip()
            ax.plot(xs, ys, styles[ai % len(styles)], marker="o", color=color, label=label)
    if slo is not None:
        ax.axhline(slo, color="red", linestyle=":", linewidth=1.2, label=f"{slo_label} {slo:g}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_ttft_cdf(
    runs: Sequence[RunSummary], targets: Sequence[str], rate: float, path: str, slo: float | None = None
) -> str:
    fig, ax = _figure(f"TTFT CDF at {rate_label(rate)} req/s", "TTFT (ms)", "fraction of requests")
    for ti, target in enumerate(targets):
        run = next((r for r in runs if r.target == target and r.rate == rate), None)
        if run is None or not run.ttfts_ms:
            continue
        xs = sorted(run.ttfts_ms)
        n = len(xs)
        ax.step(xs, [(i + 1) / n for i in range(n)], where="post", color=f"C{ti % 10}", label=target)
    if slo is not None:
        ax.axvline(slo, color="red", linestyle=":", linewidth=1.2, label=f"TTFT target {slo:g}")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small")
    return _save(fig, path)


# The metric-vs-rate plots: name (also the PNG's file name) -> (RunSummary attributes with their legend
# suffixes, title, y label, the SLO it draws as a line: "TTFT", "ITL" or None)
RATE_PLOTS: dict[str, tuple[list[tuple[str, str]], str, str, str | None]] = {
    "goodput_vs_rate": ([("goodput", "")], "Goodput vs request rate", "goodput (req/s)", None),
    "p99_itl_vs_rate": ([("itl_p99", "")], "p99 inter-token latency vs request rate", "p99 ITL (ms)", "ITL"),
    "ttft_vs_rate": ([("ttft_p50", "p50"), ("ttft_p99", "p99")], "TTFT vs request rate", "TTFT (ms)", "TTFT"),
}


def make_plots(
    runs: Sequence[RunSummary],
    targets: Sequence[str],
    rates: Sequence[float],
    out_dir: str,
    cdf_rate: float,
    ttft_slo: float | None,
    itl_slo: float | None,
) -> dict[str, str]:
    """Write the four plots; returns {name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    slos = {"TTFT": ttft_slo, "ITL": itl_slo}
    paths = {}
    for name, (attrs, title, ylabel, slo) in RATE_PLOTS.items():
        line = (slos[slo], f"{slo} target") if slo else (None, "target")
        paths[name] = plot_metric_vs_rate(runs, targets, rates, attrs, title, ylabel,
                                          os.path.join(out_dir, f"{name}.png"), *line)
    paths["ttft_cdf"] = plot_ttft_cdf(runs, targets, cdf_rate, os.path.join(out_dir, "ttft_cdf.png"), ttft_slo)
    return paths
