"""Compare-mode pieces of `pdserve bench`: go/no-go rule, transfer check maths, tables and report."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from pdserve.bench.compare import describe_workload
from pdserve.bench.compare_cli import add_compare_arguments, build_config, parse_rates
from pdserve.bench.plots import make_plots
from pdserve.bench.report import html_report, markdown_table
from pdserve.bench.resources import inequality, memory_share
from pdserve.bench.summary import RunSummary, summarize_result
from pdserve.bench.transfer import (
    NOT_CHECKED,
    TransferCheck,
    histogram_quantile,
    judge,
)
from pdserve.bench.verdict import GO, GO_UNCHECKED, NO_GO, UNDETERMINED, decide, note_resources
from pdserve.preflight.metrics import EXPIRED, FAILED, XFER_TIME, NixlSnapshot, parse_nixl

PASS = TransferCheck("pass", "3 transfers, fine")
FAIL = TransferCheck("fail", "2 failed transfer(s)")


def run(target: str, rate: float, itl_p99: float, goodput: float, completed: int = 10) -> RunSummary:
    return RunSummary(
        target,
        rate,
        completed=completed,
        goodput=goodput,
        throughput=1.0,
        itl_p99=itl_p99,
        ttft_p50=100.0,
        ttft_p99=200.0,
        ttfts_ms=[90.0, 100.0, 200.0],
    )


def sweep(
    base_itl: tuple[float, float], base_good: tuple[float, float], cand_good: tuple[float, float]
) -> list[RunSummary]:
    rates = (0.5, math.inf)
    return [run("collocated", r, i, g) for r, i, g in zip(rates, base_itl, base_good, strict=True)] + [
        run("1p1d", r, 20.0, g) for r, g in zip(rates, cand_good, strict=True)
    ]


def test_go_when_tail_hurts_transfer_passes_and_goodput_improves() -> None:
    v = decide("collocated", "1p1d", sweep((25.0, 169.0), (0.5, 0.1), (0.5, 0.3)), 30.0, PASS)
    assert v.decision == GO
    assert [c.baseline_misses for c in v.checks] == [False, True]
    assert v.reasons[0].startswith("(1) holds") and "inf" in v.reasons[0]
    # only the rates where collocated misses are judged for goodput (0.5 is a tie, inf improves)
    assert v.reasons[2].startswith("(3) holds")


def test_no_go_when_collocated_meets_its_itl_target() -> None:
    v = decide("collocated", "1p1d", sweep((25.0, 29.0), (0.5, 0.1), (0.9, 0.9)), 30.0, PASS)
    assert v.decision == NO_GO
    assert v.reasons[0].startswith("(1) fails")


def test_no_go_when_transfer_fails_or_goodput_does_not_improve() -> None:
    runs = sweep((25.0, 169.0), (0.5, 0.1), (0.5, 0.3))
    assert decide("collocated", "1p1d", runs, 30.0, FAIL).decision == NO_GO
    worse = sweep((25.0, 169.0), (0.5, 0.3), (0.5, 0.3))  # equal goodput is no improvement
    assert decide("collocated", "1p1d", worse, 30.0, PASS).decision == NO_GO
    assert decide("collocated", "1p1d", runs, 30.0, PASS, min_gain=2.0).decision == NO_GO  # needs 3x


def test_unchecked_transfer_and_missing_target() -> None:
    runs = sweep((25.0, 169.0), (0.5, 0.1), (0.5, 0.3))
    v = decide("collocated", "1p1d", runs, 30.0, NOT_CHECKED)
    assert v.decision == GO_UNCHECKED and v.reasons[1].startswith("(2) not checked")
    assert decide("collocated", "1p1d", runs, None, PASS).decision == UNDETERMINED


def test_failed_runs() -> None:
    # a rate where the baseline completed nothing counts as missing its target
    runs = [RunSummary("collocated", 1.0, error="connection refused"), run("collocated", 2.0, 10.0, 0.5),
            run("1p1d", 1.0, 5.0, 0.8), run("1p1d", 2.0, 5.0, 0.4)]  # fmt: skip
    v = decide("collocated", "1p1d", runs, 30.0, PASS)
    assert [c.baseline_misses for c in v.checks] == [True, False] and v.decision == GO
    # a failed candidate run has zero goodput
    runs = [run("collocated", 1.0, 90.0, 0.2), RunSummary("1p1d", 1.0, error="launch failed"),
            run("collocated", 2.0, 90.0, 0.2), run("1p1d", 2.0, 5.0, 0.9)]  # fmt: skip
    assert decide("collocated", "1p1d", runs, 30.0, PASS).decision == NO_GO
    # nothing completed on one side at all: nothing to compare
    runs = [RunSummary("collocated", 1.0, error="x"), run("1p1d", 1.0, 5.0, 0.8)]
    v = decide("collocated", "1p1d", runs, 30.0, PASS)
    assert v.decision == UNDETERMINED and "completed no request" in v.reasons[-1]


METRICS = """\
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.025",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.032
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_parse_prometheus_and_quantile() -> None:
    snap = parse_nixl(METRICS)
    assert (snap.counts[XFER_TIME], snap.sums[XFER_TIME], snap.counter(FAILED), snap.counter(EXPIRED),
            snap.present) == (4.0, 0.032, 0.0, 1.0, True)
    xfer = snap.buckets[XFER_TIME]
    assert xfer == {0.005: 1.0, 0.01: 3.0, 0.025: 4.0, math.inf: 4.0}
    # rank 0.9 * 4 = 3.6 lies in (0.01, 0.025]: 0.01 + 0.015 * (3.6 - 3) / (4 - 3)
    assert histogram_quantile(0.9, xfer) == pytest.approx(0.019)
    assert histogram_quantile(0.25, xfer) == pytest.approx(0.005)
    assert math.isnan(histogram_quantile(0.5, {}))
    assert histogram_quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == 0.1  # +Inf bucket: last finite bound
    both = snap + snap
    assert (both.counts[XFER_TIME], both.buckets[XFER_TIME][0.01], both.counter(EXPIRED)) == (8.0, 6.0, 2.0)


def test_judge_transfer_deltas() -> None:
    before = parse_nixl(METRICS)
    after = parse_nixl(
        METRICS.replace(
            '_count{engine="0",model_name="m"} 4.0', '_count{engine="0",model_name="m"} 14.0'
        ).replace('_sum{engine="0",model_name="m"} 0.032', '_sum{engine="0",model_name="m"} 0.232')
    )
    ok = judge(after.delta(before), 100.0, ["http://d:8200"])
    assert ok.status == "pass" and ok.transfers == 10 and ok.avg_ms == pytest.approx(20.0)
    assert judge(after.delta(before), 10.0, ["d"]).status == "fail"  # mean 20 ms over a 10 ms limit
    assert judge(before.delta(before), 100.0, ["d"]).detail.startswith("no KV transfers")
    failed = NixlSnapshot(True, {XFER_TIME: 0.05}, {XFER_TIME: 5}, {FAILED: 1})
    assert judge(failed, 100.0, ["d"]).status == "fail"
    assert judge(NixlSnapshot(), 100.0, ["d"]).detail.startswith("no vllm:nixl_* metrics")


def test_summary_table_plots_and_html(tmp_path: Path) -> None:
    result = {
        "completed": 3,
        "failed": 1,
        "request_goodput": 0.25,
        "request_throughput": 0.75,
        "p50_ttft_ms": 10.0,
        "p99_ttft_ms": 20.0,
        "p50_itl_ms": 1.0,
        "p99_itl_ms": 2.5,
        "ttfts": [0.01, 0.02, 0.0, 0.015],
        "errors": ["", "", "HTTP 500", ""],
    }
    s = summarize_result("pd", 0.5, result, "runs/pd.json")
    assert s.ttfts_ms == pytest.approx([10.0, 20.0, 15.0]) and s.goodput == 0.25 and math.isnan(s.tpot_p50)
    runs = [s, RunSummary("colo", 0.5, error="HTTP 404 Not Found\ntrace")]
    table = markdown_table(runs, ["colo", "pd"], [0.5]).splitlines()
    assert table[0].startswith(
        "| rate (req/s) | target | goodput (req/s) | req/s | p50 TTFT (ms) | p99 TTFT (ms)"
    )
    assert table[2].startswith("| 0.5 | colo | n/a") and table[2].endswith("error: HTTP 404 Not Found |")
    assert table[3] == "| 0.5 | pd | 0.250 | 0.750 | 10.00 | 20.00 | n/a | n/a | 1.00 | 2.50 | 3/1 |"
    plots = make_plots(runs, ["colo", "pd"], [0.5], str(tmp_path), 0.5, 2000.0, 30.0)
    for path in plots.values():
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    verdict = decide("colo", "pd", runs, 30.0, NOT_CHECKED)
    page = html_report(runs, ["colo", "pd"], [0.5], [verdict], plots, "Workload: test", {"k": "<v>"}, "now")
    assert page.count("data:image/png;base64,") == 4
    assert "&lt;v&gt;" in page and verdict.decision in page and "Disaggregate only if" in page


def _compare_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    return parser.parse_args(list(argv))


def test_compare_arguments() -> None:
    assert parse_rates("0.2, 0.4,inf,0.2") == [0.2, 0.4, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0,1")
    args = _compare_args(
        "--target",
        "a=127.0.0.1:1",
        "--launch",
        "collocated=collocated:2",
        "--launch",
        "pd=1p1d",
        "--transfer-check-url",
        "pd=auto",
        "--metric-percentiles",
        "90",
        "--model",
        "m",
        "--launch-args=--serve-arg='--max-model-len 512'",
    )
    cfg, spec = build_config(args)
    assert [(t.name, t.kind, t.value) for t in cfg.targets] == [
        ("a", "url", "http://127.0.0.1:1"),
        ("collocated", "launch", "collocated:2"),
        ("pd", "launch", "1p1d"),
    ]
    assert cfg.baseline == "collocated" and cfg.transfer_urls == {"pd": ["auto"]}
    assert cfg.launch_args == ["--serve-arg=--max-model-len 512"]
    # arguments `pdserve up` would reject fail before anything starts
    with pytest.raises(ValueError, match="rejects --launch-args"):
        build_config(_compare_args("--launch", "pd=1p1d", "--launch-args=--max-model-len 512"))
    assert spec.metric_percentiles == "50,90,99" and spec.percentile_metrics == "ttft,tpot,itl"
    assert spec.goodput == ["ttft:2000", "tpot:30"]  # the seed's SLOs by default
    with pytest.raises(ValueError, match="several candidate targets"):
        build_config(
            _compare_args(
                "--target",
                "x=h:1",
                "--target",
                "y=h:2",
                "--target",
                "z=h:3",
                "--transfer-check-url",
                "http://d:1",
            )
        )
    with pytest.raises(ValueError, match="baseline"):
        build_config(_compare_args("--target", "x=h:1", "--baseline", "nope"))


# -- equal resources (pdserve.bench.resources) ----------------------------------------------------------
ONE_GPU_42 = "--gpus 0 --serve-arg='--gpu-memory-utilization 0.42'"


def _one_gpu(launch_args: str, *extra: str) -> argparse.Namespace:
    return _compare_args("--launch", "collocated=collocated:1", "--launch", "pd=1p1d", "--model", "m",
                         f"--launch-args={launch_args}", *extra)


def test_an_unequal_one_gpu_comparison_is_refused_before_anything_starts() -> None:
    # the old compare1: every instance at 0.42, so collocated got half of what P and D got together
    with pytest.raises(ValueError, match=r"pd may use 0\.84 GPU of memory, collocated 0\.42.*per role"):
        build_config(_one_gpu(ONE_GPU_42))
    # on request it runs, and the verdict and the report say it is unequal
    cfg, spec = build_config(_one_gpu(ONE_GPU_42, "--allow-unequal-resources"))
    assert cfg.allow_unequal and cfg.resources["pd"].gpus == {"0": pytest.approx(0.84)}
    assert cfg.resources["collocated"].describe() == "1 GPU (0), memory 0.42 GPU [collocated: GPU 0 x 0.42]"
    verdict = decide("collocated", "1p1d", sweep((50.0, 80.0), (1.0, 0.5), (2.0, 1.0)), 30.0, PASS)
    assert verdict.decision == GO
    note_resources(verdict, "A", "B", inequality(cfg.resources))
    assert verdict.decision == f"{GO} (unequal resources)"
    assert verdict.reasons[0] == "resources: collocated A; 1p1d B" and "UNEQUAL RESOURCES" in verdict.reasons[1]
    text = describe_workload(spec, cfg)
    assert "Resources (UNEQUAL (pd may use 0.84 GPU of memory, collocated 0.42))" in text
    assert "pd: 1 GPU (0), memory 0.84 GPU [prefill: GPU 0 x 0.42; decode: GPU 0 x 0.42]" in text


def test_equal_one_gpu_comparisons_pass() -> None:
    # pdserve up's own split of a shared GPU: 0.9 for the replica, 0.45 + 0.45 for P and D
    cfg, spec = build_config(_one_gpu("--gpus 0"))
    assert {n: r.memory for n, r in cfg.resources.items()} == {"collocated": pytest.approx(0.9),
                                                               "pd": pytest.approx(0.9)}
    # per role: the replica 0.84, P and D 0.42 each
    per_role = ("--gpus 0 --collocated-arg='--gpu-memory-utilization 0.84' "
                "--prefill-arg='--gpu-memory-utilization=0.42' --decode-arg='--gpu-memory-utilization 0.42'")
    cfg, spec = build_config(_one_gpu(per_role))
    assert inequality(cfg.resources) is None
    assert "Resources (equal): collocated: 1 GPU (0), memory 0.84 GPU" in describe_workload(spec, cfg)
    verdict = decide("collocated", "1p1d", sweep((50.0, 80.0), (1.0, 0.5), (2.0, 1.0)), 30.0, PASS)
    note_resources(verdict, "A", "B", inequality(cfg.resources))
    assert verdict.decision == GO and len(verdict.reasons) == 4  # the resources line, then (1)-(3)


def test_different_gpus_and_url_targets() -> None:
    # collocated:1 over GPUs 0,1 takes GPU 0 only; 1p1d puts P on 0 and D on 1
    with pytest.raises(ValueError, match="pd runs on GPUs 0,1, collocated on 0"):
        build_config(_one_gpu("--gpus 0,1"))
    # a running server's resources are not known: reported, not compared
    cfg, spec = build_config(_compare_args("--target", "collocated=h:1", "--launch", "pd=1p1d", "--model", "m",
                                           f"--launch-args={ONE_GPU_42}"))
    assert cfg.resources["collocated"] is None and inequality(cfg.resources) is None
    assert "collocated: not known (a running server: not checked)" in describe_workload(spec, cfg)
    assert memory_share(["--x", "--gpu-memory-utilization", "0.3", "--gpu-memory-utilization=0.2"], 0.9) == 0.2
    assert memory_share(["serve"], 0.9) == 0.9
