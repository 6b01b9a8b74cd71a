"""The autoscaler's arithmetic and decisions, without a cluster: histogram quantiles from real Prometheus
text, the sliding window, and the policy's hysteresis, bounds, pressure and role switches."""

from __future__ import annotations

import math
import types

import pytest
from prometheus_client import CollectorRegistry

from pdserve.autoscale.policy import AutoscaleConfig, Autoscaler, RoleLimits, view
from pdserve.autoscale.record import AutoscaleRecord
from pdserve.autoscale.signals import (
    Histogram,
    InstanceSample,
    RoleSignals,
    SignalWindow,
    Tick,
    parse_instance_metrics,
)
from pdserve.server.metrics import ServerMetrics


def _server_metrics_text(itl: list[float], ttft: list[float], running: int, waiting: int, kv: float,
                         held: int = 1, awaiting_params: int = 0) -> str:
    """The exposition text of a real ServerMetrics registry (the names the autoscaler parses)."""
    stats = types.SimpleNamespace(num_running=running, num_waiting=waiting, kv_cache_usage=kv,
                                  prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_held=held,
                                  num_awaiting_params=awaiting_params)
    m = ServerMetrics("tiny", 512, lambda: stats, registry=CollectorRegistry())
    for v in itl:
        m.itl.observe(v)
    for v in ttft:
        m.ttft.observe(v)
    return m.render().decode()


def test_parse_instance_metrics_reads_gauges_and_histograms() -> None:
    text = _server_metrics_text(itl=[0.02] * 9 + [0.3], ttft=[0.5], running=3, waiting=2, kv=0.25)
    s = parse_instance_metrics(text)
    assert (s.running, s.waiting, s.kv_usage, s.held) == (3, 2, 0.25, 1)
    assert s.itl.count == 10 and s.ttft.count == 1
    assert not s.idle
    # 9 of 10 observations in (0.01, 0.025]: the p50 interpolates inside that bucket
    assert 0.01 < s.itl.quantile(0.5) <= 0.025
    assert s.itl.quantile(0.99) == pytest.approx(0.3 - (0.3 - 0.2) * (10 - 9.9) / 1)  # inside (0.2, 0.3]


def test_decode_legs_awaiting_params_are_not_waiting_but_not_idle() -> None:
    """An early decode leg parked for its params is the prefill's queue: it must not make decode look short of
    replicas (waiting), yet an instance holding one is not safe to stop (idle)."""
    s = parse_instance_metrics(_server_metrics_text([], [], running=0, waiting=0, kv=0.0, held=0, awaiting_params=3))
    assert (s.waiting, s.awaiting_params) == (0, 3)
    assert not s.idle
    s = parse_instance_metrics(_server_metrics_text([], [], running=0, waiting=0, kv=0.0, held=0))
    assert s.idle


def test_histogram_quantile_matches_prometheus() -> None:
    h = Histogram(((0.1, 2.0), (0.2, 6.0), (0.5, 10.0), (math.inf, 10.0)))
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.1 * (5 - 2) / 4)
    assert h.quantile(0.1) == pytest.approx(0.1 * 1 / 2)
    assert Histogram(((0.1, 0.0), (math.inf, 4.0))).quantile(0.9) == 0.1  # all in +Inf: highest finite bound
    assert Histogram(((0.1, 0.0), (math.inf, 0.0))).quantile(0.9) is None


def test_histogram_delta_and_restart() -> None:
    before = Histogram(((0.1, 5.0), (math.inf, 8.0)))
    after = Histogram(((0.1, 6.0), (math.inf, 12.0)))
    assert after.minus(before).buckets == ((0.1, 1.0), (math.inf, 4.0))
    restarted = Histogram(((0.1, 1.0), (math.inf, 2.0)))  # counts went down: count from zero
    assert restarted.minus(before) == restarted
    merged = Histogram.merge([after.minus(before), restarted])
    assert merged.buckets == ((0.1, 2.0), (math.inf, 6.0))


def _sample(itl_count: float, waiting: float = 0.0, kv: float = 0.1) -> InstanceSample:
    return InstanceSample(waiting=waiting, kv_usage=kv,
                          itl=Histogram(((0.05, itl_count), (math.inf, itl_count * 1.25))))


def test_window_signals_average_and_baseline() -> None:
    w = SignalWindow(window_s=10)
    a, b = "http://a:1", "http://b:1"
    w.add(Tick(0.0, {a: _sample(0), b: _sample(0)}, {a: 1, b: 1}))
    w.add(Tick(5.0, {a: _sample(8, waiting=2), b: None}, {a: 3, b: 0}))
    w.add(Tick(10.0, {a: _sample(16, waiting=0, kv=0.5), b: _sample(4)}, {a: 3, b: 1}))
    sig = w.signals("decode", [a, b], replicas=2, quantile=0.5)
    assert sig.replicas == 2 and sig.serving == 2
    assert sig.ongoing == pytest.approx((3 + 4) / 2)  # ticks inside the window: t=5 and t=10
    assert sig.waiting == pytest.approx(1.0)
    assert sig.kv_usage == pytest.approx(0.3)  # a's mean over the window (0.1, 0.5), above b's
    assert sig.observations == int(20 + 5)  # a: 20 since t=0; b: 5 since its first sample
    w.add(Tick(25.0, {a: _sample(16)}, {a: 0}))  # older ticks leave, one stays as the baseline
    assert w.signals("decode", [a], 1, 0.5).observations == 0


def test_early_decode_legs_are_not_decode_load() -> None:
    """Decode legs the proxy sent ahead of their prefill (parked for their params) are in the proxy's in-flight
    count but are prefill's load: they must not count as decode's ongoing requests."""
    w = SignalWindow(window_s=10)
    a = "http://a:1"
    parked = InstanceSample(awaiting_params=4)
    w.add(Tick(0.0, {a: parked}, {a: 5}))
    w.add(Tick(5.0, {a: parked}, {a: 5}))
    assert w.signals("decode", [a], replicas=1, quantile=0.5).ongoing == pytest.approx(1.0)


def _sig(replicas: int, ongoing: float = 0.0, waiting: float = 0.0, kv: float | None = None,
         latency: float | None = None) -> RoleSignals:
    return RoleSignals(replicas, replicas, ongoing, waiting, kv, latency, 0 if latency is None else 10)


def _cfg(**kw: object) -> AutoscaleConfig:
    base = dict(prefill=RoleLimits(1, 3, target_ongoing=2, latency_slo_s=1.0),
                decode=RoleLimits(1, 4, target_ongoing=4, latency_slo_s=0.05),
                upscale_delay_s=5, downscale_delay_s=20)
    base.update(kw)
    return AutoscaleConfig(**base)  # type: ignore[arg-type]


def test_view_pressure_holds_and_bounds() -> None:
    cfg = _cfg()
    assert view("decode", _sig(1, ongoing=9), cfg).desired == 3  # ceil(9 / 4)
    v = view("decode", _sig(2, ongoing=2, latency=0.08), cfg)  # ITL over its SLO: one more
    assert v.desired == 3 and "ITL p90 80.0 ms > SLO 50.0 ms" in v.pressure[0]
    v = view("decode", _sig(2, ongoing=1, kv=0.95), cfg)
    assert v.desired == 3 and "KV usage 95% > 90%" in v.pressure[0]
    v = view("decode", _sig(3, ongoing=1, latency=0.04), cfg)  # low load but ITL near the SLO: keep 3
    assert v.desired == 3 and v.holds
    assert view("decode", _sig(3, ongoing=1, latency=0.01), cfg).desired == 1
    v = view("decode", _sig(4, ongoing=40), cfg)
    assert v.desired == 4 and any("--max-decode" in h for h in v.holds)
    assert view("prefill", _sig(1, waiting=1.5), cfg).desired == 2  # a prefill queue
    v = view("prefill", _sig(2, ongoing=1, waiting=1.6), cfg)  # 0.8 waiting per replica: no headroom
    assert v.desired == 2 and "0.80 waiting per replica > 0.7 x 1" in v.holds[0]
    # a request caught waiting in one tick of the window is no queue: the pool may still shrink
    assert view("prefill", _sig(2, ongoing=1, waiting=0.2), cfg).desired == 1
    no_target = _cfg(decode=RoleLimits(1, 4))
    assert view("decode", _sig(3, ongoing=5), no_target).desired == 3
    assert view("decode", _sig(3, ongoing=0), no_target).desired == 1  # idle: down to the minimum


def test_hysteresis_scale_up_then_down() -> None:
    scaler = Autoscaler(_cfg())
    busy = {"prefill": _sig(1, ongoing=1), "decode": _sig(1, ongoing=8)}
    assert scaler.step(0.0, busy) is None
    assert scaler.step(4.9, busy) is None
    d = scaler.step(5.0, busy)
    assert d is not None and (d.action, d.role) == ("scale_up", "decode")
    assert d.numbers["decode"]["desired"] == 2 and d.numbers["decode"]["ongoing"] == 8
    assert scaler.step(6.0, busy) is None  # timers restart after an action
    idle = {"prefill": _sig(1), "decode": _sig(2)}
    assert scaler.step(10.0, idle) is None
    assert scaler.step(29.0, idle) is None
    d = scaler.step(30.0, idle)
    assert d is not None and (d.action, d.role) == ("scale_down", "decode")
    # a burst shorter than the up delay changes nothing
    scaler.step(40.0, busy)
    scaler.step(41.0, {"prefill": _sig(1, ongoing=1), "decode": _sig(2, ongoing=4)})
    assert scaler.step(46.0, busy) is None


def test_switch_when_the_other_role_has_one_to_spare() -> None:
    scaler = Autoscaler(_cfg())
    signals = {"prefill": _sig(1, ongoing=1, latency=2.5), "decode": _sig(3, ongoing=2)}  # TTFT over SLO
    scaler.step(0.0, signals)
    d = scaler.step(5.0, signals)
    assert d is not None and (d.action, d.role, d.from_role) == ("switch", "prefill", "decode")
    assert "TTFT p90 2500.0 ms > SLO 1000.0 ms" in d.reason
    scaler = Autoscaler(_cfg(allow_role_switch=False))
    scaler.step(0.0, signals)
    d = scaler.step(5.0, signals)
    assert d is not None and d.action == "scale_up"
    # the other role at its minimum has nothing to spare
    scaler = Autoscaler(_cfg())
    signals = {"prefill": _sig(1, ongoing=1, latency=2.5), "decode": _sig(1, ongoing=0)}
    scaler.step(0.0, signals)
    d = scaler.step(5.0, signals)
    assert d is not None and d.action == "scale_up"


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min"):
        AutoscaleConfig(decode=RoleLimits(3, 2)).validate()
    with pytest.raises(ValueError, match="quantile"):
        AutoscaleConfig(quantile=1.0).validate()
    cfg = _cfg()
    assert AutoscaleConfig.from_json(cfg.to_json()) == cfg


def test_record_logs_json_lines_and_metrics(tmp_path) -> None:
    import json

    from prometheus_client import generate_latest

    rec = AutoscaleRecord(tmp_path / "autoscaler.log")
    scaler = Autoscaler(_cfg(upscale_delay_s=0))
    d = scaler.step(0.0, {"prefill": _sig(1), "decode": _sig(1, ongoing=8)})
    assert d is not None
    rec.observe(scaler.last_views)
    rec.decision(d)
    rec.event("done", "added x")
    lines = [json.loads(line) for line in (tmp_path / "autoscaler.log").read_text().splitlines()]
    assert [e["kind"] for e in lines] == ["decision", "done"]
    assert lines[0]["numbers"]["decode"]["ongoing"] == 8 and lines[0]["action"] == "scale_up"
    assert [e["seq"] for e in rec.since(1)] == [2]
    text = generate_latest(rec.registry).decode()
    assert 'pdserve_autoscaler_decisions_total{action="scale_up",role="decode"} 1.0' in text
    assert 'pdserve_autoscaler_desired_replicas{role="decode"} 2.0' in text
    assert 'pdserve_autoscaler_signal{role="decode",signal="latency_q_seconds"} NaN' in text
