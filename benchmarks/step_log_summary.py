"""Summarises a `PDSERVE_STEP_LOG` file: step time split by kind (graph decode, eager decode, mixed,
prefill only), where the time went (gap between steps, scheduling, model, waiting on the device,
bookkeeping), and the requests' lifecycle medians, optionally restricted to a time window. Where the log
has the stepping thread's scheduler counters (Linux), also where its wall time went: on a CPU, waiting on
the run queue, blocked (GIL, locks), inside steps and between them, and the other threads' CPU meanwhile.

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
    if all("run_ms" in s for s in steps):
        lines.append(thread_time(steps, by_kind))
    return "\n".join(lines)


def thread_time(steps: list[dict], by_kind: dict[str, list[dict]]) -> str:
    """Totals of the stepping thread's time (s) inside steps and in the gaps between them, and per kind the
    mean per step (ms): on a CPU, runnable but waiting for one, blocked; the process's other threads' CPU."""
    def total(group: list[dict], key: str) -> float:
        return sum(s.get(key, 0.0) for s in group) / 1e3

    lines = []
    for where, prefix in (("inside steps", ""), ("between steps", "gap_")):
        run, rq, blocked = (total(steps, f"{prefix}{k}") for k in ("run_ms", "rq_ms", "blocked_ms"))
        wall = run + rq + blocked
        lines.append(f"stepping thread {where}: {wall:.2f} s = on CPU {run:.2f} s ({run / max(wall, 1e-9):.0%}), "
                     f"run queue {rq:.2f} s ({rq / max(wall, 1e-9):.0%}), blocked {blocked:.2f} s "
                     f"({blocked / max(wall, 1e-9):.0%}); other threads' CPU {total(steps, f'{prefix}other_run_ms'):.2f} s")
    lines.append(f"{'kind':<13}{'run':>8}{'rq':>8}{'blocked':>9}{'others':>8}  (ms per step, mean)")
    for k, group in sorted(by_kind.items()):
        lines.append(f"{k:<13}" + "".join(
            f"{statistics.mean(s[key] for s in group):>{w}.2f}"
            for key, w in (("run_ms", 8), ("rq_ms", 8), ("blocked_ms", 9), ("other_run_ms", 8))))
    return "\n".join(lines)


def window_stats(path: str, since: float, until: float) -> dict:
    """One benchmark run's steps (`t` in [since, until], the log's monotonic clock): counts of step kinds,
    decode-only step time p50, and the stepping thread's on-CPU / run-queue / blocked seconds inside steps
    and between them, with the other threads' CPU seconds (empty without a log)."""
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return {}
    steps = [s for s in lines if "request" not in s and since <= s["t"] <= until]
    if not steps:
        return {}
    decode = [s["sched_ms"] + s["exec_ms"] + s["post_ms"] for s in steps if s["prefill_tokens"] == 0]
    out: dict = {"steps": len(steps), "mixed_steps": sum(1 for s in steps if 0 < s["prefill_tokens"] < s["tokens"]),
                 "prefill_only_steps": sum(1 for s in steps if s["prefill_tokens"] == s["tokens"]),
                 "multi_thread_steps": sum(1 for s in steps if s.get("threads", 1) > 1),
                 "decode_step_p50_ms": pct(decode, 0.5), "decode_seqs_p50": pct(
                     [s["seqs"] for s in steps if s["prefill_tokens"] == 0], 0.5)}
    if all("run_ms" in s for s in steps):
        for prefix, where in (("", "step"), ("gap_", "gap")):
            # the first step's gap reaches back before the window (the engine idled between runs)
            group = steps if prefix == "" else steps[1:]
            for key in ("run_ms", "rq_ms", "blocked_ms", "other_run_ms"):
                out[f"{where}_{key.removesuffix('_ms')}_s"] = round(sum(s.get(prefix + key, 0.0) for s in group) / 1e3, 3)
    return out


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
