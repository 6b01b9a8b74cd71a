"""Summarises a `PDSERVE_STEP_LOG` file: step time split by kind (graph decode, eager decode, mixed,
prefill only), where the time went (gap between steps, scheduling, model, waiting on the device,
bookkeeping), and the requests' lifecycle medians, optionally restricted to a time window.

    python benchmarks/step_log_summary.py steps.jsonl [--since T] [--until T]
"""

from __future__ import annotations

import argparse
import json
import statistics


def kind(step: dict) -> str:
    if step["prefill_tokens"] == 0:
        return "decode-graph" if step["graph"] else "decode-eager"
    return "prefill-only" if step["prefill_tokens"] == step["tokens"] else "mixed"


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(steps: list[dict]) -> str:
    lines = [f"{len(steps)} steps"]
    if not steps:
        return lines[0]
    span = steps[-1]["t"] - steps[0]["t"]
    busy = sum(s["sched_ms"] + s["exec_ms"] + s["post_ms"] for s in steps) / 1e3
    lines.append(f"span {span:.2f} s, inside steps {busy:.2f} s ({busy / max(span, 1e-9):.0%})")
    header = f"{'kind':<13}{'n':>6}{'seqs p50':>9}{'step p50':>10}{'step p99':>10}{'gap p50':>9}{'gap p99':>9}" \
             f"{'sched':>8}{'exec':>8}{'wait':>8}{'post':>8}  (ms)"
    lines.append(header)
    by_kind: dict[str, list[dict]] = {}
    for s in steps:
        by_kind.setdefault(kind(s), []).append(s)
    for k, group in sorted(by_kind.items()):
        total = [s["sched_ms"] + s["exec_ms"] + s["post_ms"] for s in group]
        gaps = [s["gap_ms"] for s in group]
        lines.append(
            f"{k:<13}{len(group):>6}{statistics.median(s['seqs'] for s in group):>9.0f}"
            f"{pct(total, 0.5):>10.2f}{pct(total, 0.99):>10.2f}{pct(gaps, 0.5):>9.2f}{pct(gaps, 0.99):>9.2f}"
            f"{statistics.mean(s['sched_ms'] for s in group):>8.2f}{statistics.mean(s['exec_ms'] for s in group):>8.2f}"
            f"{statistics.mean(s['wait_ms'] for s in group):>8.2f}{statistics.mean(s['post_ms'] for s in group):>8.2f}"
        )
    return "\n".join(lines)


def summarise_requests(requests: list[dict]) -> str:
    """Median times from a request's arrival in the engine (ms): remote KV load started and done,
    first scheduled, first token, finished."""
    keys = ("load_start_ms", "load_done_ms", "scheduled_ms", "first_token_ms", "finished_ms")
    cells = []
    for key in keys:
        values = [r[key] for r in requests if r.get(key) is not None]
        cells.append(f"{key.removesuffix('_ms')} {statistics.median(values):.2f}" if values else f"{key.removesuffix('_ms')} -")
    return f"{len(requests)} requests, p50 ms after arrival: " + ", ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--since", type=float, default=None, help="first step time (the log's clock)")
    ap.add_argument("--until", type=float, default=None)
    args = ap.parse_args()
    with open(args.path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    lines = [s for s in lines if (args.since is None or s["t"] >= args.since)
             and (args.until is None or s["t"] <= args.until)]
    print(summarise([s for s in lines if "request" not in s]))
    requests = [s for s in lines if "request" in s and not s["request"].startswith("__warmup")]
    if requests:
        print(summarise_requests(requests))


if __name__ == "__main__":
    main()
