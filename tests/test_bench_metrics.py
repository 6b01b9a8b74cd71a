"""Metric maths of `pdserve bench` on synthetic timelines with known answers (vLLM's definitions)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.metrics import (
    calculate_metrics,
    parse_goodput,
    parse_percentile_metrics,
    peak_output_and_concurrency,
    percentile_word,
    summarize,
)
from pdserve.bench.options import BenchSpec
from pdserve.bench.result import build_result, format_block
from pdserve.bench.types import RequestOutput


def _ok(
    start: float, ttft: float, itl: list[float], tokens: int, prompt_len: int = 10, text: str = ""
) -> RequestOutput:
    return RequestOutput(
        generated_text=text,
        success=True,
        latency=ttft + sum(itl),
        output_tokens=tokens,
        ttft=ttft,
        itl=list(itl),
        prompt_len=prompt_len,
        start_time=start,
    )


def timeline() -> list[RequestOutput]:
    return [
        _ok(0.0, 0.1, [0.02, 0.03, 0.05], 4, prompt_len=11),  # A: latency 0.2, tpot 0.1/3
        _ok(0.5, 0.3, [0.01], 2, prompt_len=12),  # B: latency 0.31, tpot 0.01
        _ok(1.2, 0.05, [], 1, prompt_len=13),  # C: one token -> no TPOT, counts 0 for goodput
        RequestOutput(success=False, error="HTTP 500", prompt_len=99, start_time=0.3),  # D: failed
        _ok(0.2, 0.2, [0.1, 0.1], 0, prompt_len=14, text="a b c"),  # E: no usage -> re-tokenised: 3
    ]


def count_words(text: str) -> int:
    return len(text.split())


def test_counts_and_throughputs() -> None:
    m, lens = calculate_metrics(timeline(), 2.0, count_words, [50, 99], {})
    assert (m.completed, m.failed) == (4, 1)
    assert lens == [4, 2, 1, 0, 3]
    assert m.total_input == 11 + 12 + 13 + 14
    assert m.total_output == 10
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx((50 + 10) / 2.0)
    assert m.request_goodput == 0.0
    assert m.errors == ["HTTP 500"]


def test_no_tokenizer_counts_one_token_without_usage() -> None:
    _, lens = calculate_metrics(timeline(), 2.0, None, [99], {})
    assert lens == [4, 2, 1, 0, 1]


def test_ttft_stats_known_values() -> None:
    m, _ = calculate_metrics(timeline(), 2.0, count_words, [50, 99], {})
    # TTFTs of the successful requests: 0.1, 0.3, 0.05, 0.2 s
    assert m.ttft.mean == pytest.approx(162.5)
    assert m.ttft.median == pytest.approx(150.0)
    assert m.ttft.std == pytest.approx(math.sqrt(0.036875 / 4) * 1000)  # population std
    assert m.ttft.percentiles[0] == (50.0, pytest.approx(150.0))
    # linear interpolation: rank 0.99 * 3 = 2.97 between 0.2 and 0.3
    assert m.ttft.percentiles[1] == (99.0, pytest.approx(297.0))


def test_tpot_excludes_single_token_requests() -> None:
    m, _ = calculate_metrics(timeline(), 2.0, count_words, [99], {})
    tpots_ms = [100.0 / 3.0, 10.0, 100.0]  # A, B, E ((0.4 - 0.2) / (3 - 1)); C excluded
    assert m.tpot.mean == pytest.approx(np.mean(tpots_ms))
    assert m.tpot.median == pytest.approx(100.0 / 3.0)
    assert m.tpot.percentiles[0][1] == pytest.approx(float(np.percentile(tpots_ms, 99)))


def test_itl_pools_all_gaps_and_e2el_is_latency() -> None:
    m, _ = calculate_metrics(timeline(), 2.0, count_words, [99], {})
    gaps = [0.02, 0.03, 0.05, 0.01, 0.1, 0.1]
    assert m.itl.mean == pytest.approx(sum(gaps) / 6 * 1000)
    assert m.itl.median == pytest.approx(40.0)
    assert m.e2el.mean == pytest.approx((0.2 + 0.31 + 0.05 + 0.4) / 4 * 1000)


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        ({"ttft": 250.0, "tpot": 50.0}, 2),  # A (ttft .1, tpot 33 ms) and C (tpot counts as 0)
        ({"e2el": 300.0}, 2),  # A (.2) and C (.05)
        ({"ttft": 100.0}, 2),  # boundary: slo >= value is good (A at exactly 100 ms, C)
        ({"ttft": 1000.0, "tpot": 1000.0, "e2el": 1000.0}, 4),  # every completed request; D never good
        ({"tpot": 0.0}, 1),  # only C (TPOT counted as 0)
    ],
)
def test_goodput(slo: dict[str, float], good: int) -> None:
    m, _ = calculate_metrics(timeline(), 2.0, count_words, [99], slo)
    assert m.good_completed == good
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_peak_buckets() -> None:
    # token times: A .1 .12 .15 .2, B .8 .81, E .4 .5 .6 -> second 0 has 9; C 1.25 -> second 1
    # active: A, B, E in second 0; C in second 1
    assert peak_output_and_concurrency(timeline()) == (9.0, 3)
    assert peak_output_and_concurrency([RequestOutput(success=False)]) == (0.0, 0)
    spread = [_ok(0.0, 0.5, [1.0, 1.0], 3), _ok(1.5, 0.1, [0.1], 2)]
    # tokens at .5, 1.5, 2.5 and 1.6, 1.7 -> second 1 has 3; active: first in 0..2, second in 1
    assert peak_output_and_concurrency(spread) == (3.0, 2)


def test_empty_lists_read_as_zero() -> None:
    m, _ = calculate_metrics([RequestOutput(success=False, error="x")], 1.0, None, [99], {"ttft": 1.0})
    assert m.completed == 0 and m.request_goodput == 0.0
    assert (m.ttft.mean, m.tpot.median, m.itl.percentiles[0][1]) == (0.0, 0.0, 0.0)


def test_summarize_matches_numpy() -> None:
    rng = np.random.default_rng(3)
    xs = list(rng.exponential(0.05, size=101))
    s = summarize(xs, [25, 90, 99.9])
    assert s.mean == pytest.approx(np.mean(xs) * 1000)
    assert s.std == pytest.approx(np.std(xs) * 1000)
    assert [p for p, _ in s.percentiles] == [25.0, 90.0, 99.9]
    assert s.percentiles[2][1] == pytest.approx(np.percentile(xs, 99.9) * 1000)


def test_parsers() -> None:
    assert parse_goodput(["ttft:2000", "tpot:30"]) == {"ttft": 2000.0, "tpot": 30.0}
    for bad in (["itl:30"], ["ttft=30"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentile_metrics("ttft, itl,e2el") == ["ttft", "itl", "e2el"]
    with pytest.raises(ValueError):
        parse_percentile_metrics("ttft,foo")
    assert (percentile_word(99.0), percentile_word(99.9), percentile_word(50)) == ("99", "99.9", "50")


def _spec(**kw: object) -> BenchSpec:
    spec = BenchSpec(**kw)  # type: ignore[arg-type]
    spec.normalise()
    return spec


def test_printed_block_exact_format() -> None:
    outs = timeline()
    m, _ = calculate_metrics(outs, 2.0, count_words, [50, 99], {"ttft": 250.0})
    spec = _spec(request_rate=4.0, max_concurrency=8)
    block = format_block(spec, m, 2.0, {"ttft": 250.0}, ["ttft", "tpot", "itl", "e2el"], [50, 99], outs)
    lines = block.split("\n")
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     4         "
    assert lines[2] == "Failed requests:                         1         "
    assert lines[3] == "Maximum request concurrency:             8         "
    assert lines[4] == "Request rate configured (RPS):           4.00      "
    assert lines[5] == "Benchmark duration (s):                  2.00      "
    assert "Request goodput (req/s):                 1.50      " in lines  # A, C, E meet ttft 250 ms
    assert "Peak concurrent requests:                3.00      " in lines
    for header in (
        "---------------Time to First Token----------------",
        "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------",
        "----------------End-to-end Latency----------------",
    ):
        assert header in lines
    assert "P99 TTFT (ms):                           297.00    " in lines
    assert "Median TTFT (ms):                        150.00    " in lines
    assert lines[-1] == "=" * 50
    # no goodput, infinite rate, no concurrency limit: those rows disappear
    plain = format_block(_spec(), m, 2.0, {}, ["ttft"], [99], outs).split("\n")
    assert not any(
        line.startswith(("Request goodput", "Request rate configured", "Maximum request")) for line in plain
    )
    assert "---------------Inter-token Latency----------------" not in plain


def test_result_keys_like_vllm() -> None:
    outs = timeline()
    m, lens = calculate_metrics(outs, 2.0, count_words, [50, 99.9], {})
    spec = _spec(request_rate=2.0, max_concurrency=4)
    result = build_result(
        spec, outs, lens, m, 2.0, {}, ["ttft", "tpot", "itl", "client_queue_time"], [50, 99.9]
    )
    for key in (
        "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
        "itls", "latencies", "start_times", "queue_times", "generated_texts", "errors", "max_output_tokens_per_s",
        "max_concurrent_requests", "rtfx", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms",
        "p99.9_ttft_ms", "mean_tpot_ms", "p99.9_itl_ms", "mean_client_queue_time_ms",
    ):  # fmt: skip
        assert key in result, key
    assert result["request_goodput"] is None
    assert "mean_e2el_ms" not in result
    assert result["p50_ttft_ms"] == pytest.approx(150.0)
    assert result["output_lens"] == [4, 2, 1, 0, 3]


def test_spec_validation() -> None:
    spec = _spec(dataset_path="x.jsonl", max_concurrency=2)
    assert spec.dataset_name == "jsonl" and spec.endpoint == "/v1/completions" and spec.ignore_eos is False
    assert spec.request_id_prefix.startswith("bench-") and _spec(dataset_name="random").ignore_eos is True
    assert _spec(backend="openai-chat").endpoint == "/v1/chat/completions"
    assert _spec(api_key="k", header=["x-a=1"]).request_headers() == {"Authorization": "Bearer k", "x-a": "1"}
    assert _spec(temperature=0.0, extra_body={"top_k": 3}).sampling_body() == {"temperature": 0.0, "top_k": 3}
    for bad in (
        {"goodput": ["itl:3"]},
        {"metric_percentiles": "50,x"},
        {"percentile_metrics": "ttft,foo"},
        {"metadata": ["novalue"]},
        {"dataset_name": "sharegpt"},
        {"dataset_name": "jsonl"},
        {"max_concurrency": 0},
        {"request_rate": 0.0},
    ):
        with pytest.raises(ValueError):
            _spec(**bad)


def test_cached_prompt_tokens_from_usage() -> None:
    outs = timeline()
    m, _ = calculate_metrics(outs, 2.0, count_words, [50], {})
    assert m.total_cached_input is None  # no server said: no "Cached input tokens" row
    assert "Cached input tokens" not in format_block(BenchSpec(), m, 2.0, {}, ["ttft"], [50], outs)
    outs[0].cached_tokens, outs[1].cached_tokens = 8, 0
    outs[3].cached_tokens = 50  # a failed request: not counted
    m, _ = calculate_metrics(outs, 2.0, count_words, [50], {})
    assert m.total_cached_input == 8
    block = format_block(BenchSpec(), m, 2.0, {}, ["ttft"], [50], outs)
    assert "Cached input tokens:" in block and "Computed input tokens:" in block
    assert build_result(BenchSpec(), outs, [1] * 5, m, 2.0, {}, ["ttft"], [50])["total_cached_input_tokens"] == 8
