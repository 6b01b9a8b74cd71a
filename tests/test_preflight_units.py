"""`pdserve preflight` logic without a deployment: parsers, row decisions, the NIXL probe on DRAM."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdserve.preflight.checks import (
    FAIL,
    PASS,
    SKIP,
    Check,
    Instance,
    Options,
    Target,
    TransferRun,
    check_configs,
    check_counters,
    check_transfer_time,
)
from pdserve.preflight.cli import check_gpu_p2p, check_ucx_transport, verdict
from pdserve.preflight.gpu import ProbeResult, p2p_status, parse_topo_p2p, run_probe
from pdserve.preflight.metrics import EXPIRED, FAILED, XFER_TIME, NixlSnapshot, parse_log_line, parse_nixl
from pdserve.preflight.probe import parse_proto_info

TOPO = """\
 \tGPU0\tGPU1\tGPU2\t
 GPU0\tX\tOK\tCNS\t
 GPU1\tOK\tX\tCNS\t
 GPU2\tCNS\tCNS\tX\t

Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
"""

PROTO_GPU = """\
[1.0] [h:1:0]   +------+-------------+-----------------+
[1.0] [h:1:0]   | dec intra-node cfg#2                 |
[1.0] [h:1:0]   | remote memory read by ucp_get* into cuda memory from cuda |
[1.0] [h:1:0]   +------+-------------+-----------------+
[1.0] [h:1:0]   | Range  | Description |   Config      |
[1.0] [h:1:0]   +------+-------------+-----------------+
[1.0] [h:1:0]   | 0..inf | zero-copy   | {transport}   |
[1.0] [h:1:0]   +------+-------------+-----------------+
[1.0] [h:1:0]   | dec intra-node cfg#2                 |
[1.0] [h:1:0]   | active message by ucp_am_send* from host memory |
[1.0] [h:1:0]   | 0..inf | zero-copy   | tcp/lo        |
"""


def test_parse_topo_p2p() -> None:
    m = parse_topo_p2p(TOPO)
    assert m[("GPU0", "GPU1")] == "OK" and m[("GPU1", "GPU2")] == "CNS" and m[("GPU2", "GPU2")] == "X"
    assert len(m) == 9


def test_parse_proto_info_and_verdict() -> None:
    fast = parse_proto_info(PROTO_GPU.format(transport="cuda_ipc/cuda"))
    assert fast == [("remote memory read by ucp_get* into cuda memory from cuda", "cuda_ipc/cuda")]
    # the active-message table's tcp/lo is not a read path and is ignored
    assert ProbeResult(True, ok=True, transports=fast, gbps=80.0).verdict()[0] == PASS
    slow = parse_proto_info(PROTO_GPU.format(transport="tcp/lo"))
    status, why = ProbeResult(True, ok=True, transports=slow, gbps=0.5, env={}).verdict()
    assert status == FAIL and "tcp/lo" in why and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in why
    assert ProbeResult(False, error="no nixl").verdict() == (SKIP, "no nixl")
    assert ProbeResult(True, ok=False, error="READ ended in state ERR").verdict()[0] == FAIL


def test_nixl_probe_on_dram_reports_its_read_transport() -> None:
    pytest.importorskip("nixl")
    res = run_probe("", "", {}, mem="dram", size_mib=1, timeout=120)
    assert res.ran and res.ok, res.error
    assert res.transports and all("remote memory read" in title for title, _ in res.transports)
    assert res.gbps is not None and res.gbps > 0


def test_same_gpu_is_p2p_ok_without_nvml() -> None:
    r = p2p_status("0", "0")
    assert r.status == "ok" and r.source == "same-gpu"


def _inst(role: str, port: int, **info: object) -> Instance:
    base = {"version": "0.1.0", "model": "/m/tiny", "served_model_name": "tiny", "dtype": "float32",
            "block_size": 16, "kv_layout": "LBHNC", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
            "max_model_len": 1024, "device": "cpu", "side_channel_host": "127.0.0.1",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer", "side_channel_port": port + 1000}
    base.update(info)
    return Instance(role, f"http://127.0.0.1:{port}", healthy=True, info=base, engine="pdserve")


def test_check_configs() -> None:
    ok = check_configs(Target([_inst("prefill", 1), _inst("decode", 2)], True))
    assert ok.status == PASS and "block_size=16" in ok.detail
    bad = check_configs(Target([_inst("prefill", 1, block_size=8), _inst("decode", 2)], True))
    assert bad.status == FAIL and "block_size differs" in bad.detail and "=8" in bad.detail
    bad = check_configs(Target([_inst("prefill", 1, kv_role="kv_consumer"), _inst("decode", 2)], True))
    assert bad.status == FAIL and "kv_role=kv_consumer" in bad.detail
    bad = check_configs(Target([_inst("prefill", 1), _inst("decode", 2, side_channel_port=1001)], True))
    assert bad.status == FAIL and "share side channel" in bad.detail
    bad = check_configs(Target([_inst("prefill", 1, version="0.2.0"), _inst("decode", 2)], True))
    assert bad.status == FAIL and "version differs" in bad.detail


def test_gpu_rows_skip_on_cpu_and_need_gpu_ids() -> None:
    cpu = Target([_inst("prefill", 1), _inst("decode", 2)], True)
    for row in (check_gpu_p2p(cpu, Options()), check_ucx_transport(cpu, Options())):
        assert row.status == SKIP and "CPU" in row.detail
    gpu = Target([_inst("prefill", 1, device="cuda:0"), _inst("decode", 2, device="cuda:0")], True)
    row = check_gpu_p2p(gpu, Options())
    assert row.status == SKIP and "--prefill-gpu" in row.detail
    row = check_gpu_p2p(gpu, Options(prefill_gpu="3", decode_gpu="3"))
    assert row.status == PASS and "GPU 3 serves both" in row.detail
    # what `pdserve up` deploys: each instance sees one GPU and reports which physical one in /pdserve/info
    up = Target([_inst("prefill", 1, device="cuda:0", cuda_visible_devices="2"),
                 _inst("decode", 2, device="cuda:0", cuda_visible_devices="2")], True)
    row = check_gpu_p2p(up, Options())
    assert row.status == PASS and "GPU 2 serves both" in row.detail


def _snap(transfers: int, xfer_s: float, nbytes: float, failed: float = 0, expired: float = 0) -> NixlSnapshot:
    return NixlSnapshot(
        True, {XFER_TIME: xfer_s, "vllm:nixl_bytes_transferred": nbytes},
        {XFER_TIME: transfers, "vllm:nixl_bytes_transferred": transfers},
        {FAILED: failed, EXPIRED: expired},
    )


def _run(after: NixlSnapshot, errors: list[str] | None = None) -> tuple[TransferRun, Target]:
    target = Target([_inst("prefill", 1), _inst("decode", 2)], True)
    before = {i.url: _snap(0, 0.0, 0.0) for i in target.instances}
    return TransferRun(before, {**before, "http://127.0.0.1:2": after}, 3, 1024, errors or []), target


def test_check_transfer_time() -> None:
    # 3 transfers of 512 KiB in 2 ms each: expected 512 KiB / 5 GB/s + 5 ms floor = 5.1 ms
    run, target = _run(_snap(3, 0.006, 3 * 512 * 1024))
    row = check_transfer_time(run, Options(), target)
    assert row.status == PASS and row.data["avg_bytes"] == 512 * 1024 and "cpu-dram" in row.detail
    assert row.data["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    row = check_transfer_time(run, Options(slow_factor=0.1), target)
    assert row.status == FAIL and "the KV path is slow" in row.detail
    run, target = _run(_snap(3, 3 * 0.25, 3 * 512 * 1024))  # 250 ms each
    row = check_transfer_time(run, Options(slow_factor=1000), target)
    assert row.status == FAIL and ">= 100 ms" in row.detail
    run, target = _run(_snap(0, 0.0, 0.0, failed=3))
    row = check_transfer_time(run, Options(), target)
    assert row.status == FAIL and "3 failed transfer(s)" in row.detail
    run, target = _run(_snap(3, 0.006, 3 * 512 * 1024), errors=["HTTP 500"])
    assert check_transfer_time(run, Options(), target).status == FAIL


def test_check_counters_judges_only_what_happened_during_preflight() -> None:
    run, target = _run(_snap(3, 0.006, 1e6))
    assert check_counters(run.before, run.after, target).status == PASS
    run, target = _run(_snap(3, 0.006, 1e6, expired=2))
    row = check_counters(run.before, run.after, target)
    assert row.status == FAIL and "nixl_num_kv_expired_reqs +2 during preflight" in row.detail
    assert "kv_lease_duration" in row.detail and row.data["nixl_num_kv_expired_reqs"] == 2
    # failures from before the run (a fault fixed since; a process's totals only grow): reported, not judged
    earlier = {url: _snap(3, 0.006, 1e6, failed=5, expired=1) for url in run.before}
    row = check_counters(earlier, earlier, target)
    assert row.status == PASS and "before it, not judged" in row.detail and "nixl_num_failed_transfers=5" in row.detail
    assert row.data["before_preflight"]["nixl_num_failed_transfers"] == 10
    later = {**earlier, "http://127.0.0.1:2": _snap(3, 0.006, 1e6, failed=6, expired=1)}
    row = check_counters(earlier, later, target)
    assert row.status == FAIL and "nixl_num_failed_transfers +1 during preflight (total 6)" in row.detail


def test_verdict() -> None:
    assert verdict([Check("a", PASS, ""), Check("kv transfer time", PASS, "")])[0]
    ok, text = verdict([Check("instances", FAIL, ""), Check("b", SKIP, ""), Check("c", FAIL, "")])
    assert not ok and text.startswith("NO-GO: fix instances") and "c" in text


def test_parse_metrics_text_and_log_line() -> None:
    reg = CollectorRegistry()
    labels = {"model_name": "m", "engine": "0"}
    h = Histogram("vllm:nixl_xfer_time_seconds", "t", list(labels), registry=reg)
    b = Histogram("vllm:nixl_bytes_transferred", "b", list(labels), registry=reg)
    c = Counter("vllm:nixl_num_failed_transfers", "f", list(labels), registry=reg)
    Counter("vllm:nixl_num_kv_expired_reqs", "e", list(labels), registry=reg)
    h.labels(**labels).observe(0.004)
    h.labels(**labels).observe(0.006)
    b.labels(**labels).observe(2**20)
    b.labels(**labels).observe(2**20)
    c.labels(**labels).inc()
    snap = parse_nixl(generate_latest(reg).decode())
    assert snap.present and snap.transfers == 2 and snap.avg_xfer_s == pytest.approx(0.005)
    assert snap.avg_bytes == 2**20 and snap.counter(FAILED) == 1 and snap.counter(EXPIRED) == 0
    xfer = snap.buckets[XFER_TIME]  # cumulative, prometheus_client's default bounds
    assert (xfer[0.005], xfer[0.01], xfer[float("inf")]) == (1.0, 2.0, 2.0)
    assert snap.delta(snap).buckets[XFER_TIME][0.01] == 0.0 and (snap + snap).buckets[XFER_TIME][0.01] == 4.0
    line = snap.summary_line()
    assert "Num successful transfers=2" in line and "Avg xfer time (ms)=5.000" in line
    assert parse_nixl("# nothing\nvllm:num_requests_running 0\n").present is False
    parsed = parse_log_line(
        "INFO 12:00:00 metrics.py:99] KV Transfer metrics: Num successful transfers=2, Avg xfer time (ms)=63.33, "
        "P90 xfer time (ms)=66.245, Avg MB per transfer=15.75, Throughput (MB/s)=248.699"
    )
    assert parsed["Num successful transfers"] == 2 and parsed["Avg xfer time (ms)"] == 63.33
    assert parsed["Throughput (MB/s)"] == 248.699


def test_cli_arguments() -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve", "preflight"], capture_output=True, text=True)
    assert out.returncode == 2 and "--proxy" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pdserve", "preflight", "--proxy", "x", "--bandwidth", "fast"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "bandwidth" in out.stderr
    # nothing listens there: the instances row fails, the others are skipped, exit 1
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "pdserve", "preflight", "--proxy", f"127.0.0.1:{port}", "--json"],
                         capture_output=True, text=True, timeout=60)
    import json

    data = json.loads(out.stdout)
    assert out.returncode == 1 and data["verdict"] == "no-go"
    assert data["checks"][0]["name"] == "instances" and data["checks"][0]["status"] == FAIL
    assert {c["status"] for c in data["checks"][1:]} == {SKIP}


def test_check_configs_reports_tensor_parallel_sizes() -> None:
    target = Target([_inst("prefill", 1, tensor_parallel_size=2), _inst("decode", 2)], True)
    row = check_configs(target)
    assert row.status == PASS and "tensor parallel: prefill TP 2, decode TP 1" in row.detail
    assert row.data["fields"]["tensor_parallel_size"] == {"127.0.0.1:1": 2, "127.0.0.1:2": 1}
    # a size that cannot split the KV heads (only reachable by a hand-edited info, but named if it is)
    bad = check_configs(Target([_inst("prefill", 1, tensor_parallel_size=3), _inst("decode", 2)], True))
    assert bad.status == FAIL and "tensor_parallel_size 3, which does not split 2 KV heads" in bad.detail
    assert "tensor parallel" not in check_configs(Target([_inst("prefill", 1), _inst("decode", 2)], True)).detail


def test_check_configs_names_the_fp8_scale_sources_without_failing() -> None:
    """A checkpoint-scale producer and a dynamic-scale consumer interoperate (every fp8 row carries its
    scale): the row says where each instance's scales come from and still passes."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    row = check_configs(Target([_inst("prefill", 1, kv_cache_scales="checkpoint", **fp8),
                                _inst("decode", 2, kv_cache_scales="dynamic", **fp8)], True))
    assert row.status == PASS and "fp8 scales: checkpoint / dynamic (interoperable)" in row.detail
    assert row.data["fields"]["kv_cache_scales"] == {"127.0.0.1:1": "checkpoint", "127.0.0.1:2": "dynamic"}
    plain = check_configs(Target([_inst("prefill", 1, kv_cache_scales="none"), _inst("decode", 2)], True))
    assert "fp8 scales" not in plain.detail


def test_check_transfer_time_counts_decode_ranks_on_gpus() -> None:
    after = _snap(3, 3 * 0.006, 3 * 64 * 2**20)  # 64 MiB in 6 ms each
    target = Target([_inst("prefill", 1, device="cuda:0"),
                     _inst("decode", 2, device="cuda:0", tensor_parallel_size=4)], True)
    before = {i.url: _snap(0, 0.0, 0.0) for i in target.instances}
    run = TransferRun(before, {**before, "http://127.0.0.1:2": after}, 3, 1024, [])
    row = check_transfer_time(run, Options(bandwidth="50GB/s", latency_floor_ms=0.5), target)
    # 64 MiB / 4 ranks / 50 GB/s + 0.5 ms = 0.84 ms expected
    assert abs(row.data["expected_s"] - (64 * 2**20 / 4 / 50e9 + 0.0005)) < 1e-9
    assert "per decode rank x 4 ranks" in row.detail


def test_gpu_pairs_follow_the_tensor_parallel_reads() -> None:
    from pdserve.preflight.cli import _pairs

    # prefill TP=2 on GPUs 0,1 and decode TP=1 on GPU 2: the decode rank reads from both prefill GPUs
    target = Target([_inst("prefill", 1, device="cuda:0", cuda_visible_devices="0,1", tensor_parallel_size=2),
                     _inst("decode", 2, device="cuda:0", cuda_visible_devices="2")], True)
    assert _pairs(target, Options()) == ([("0", "2"), ("1", "2")], None)
    # prefill TP=1 on 0, decode TP=2 on 2,3: each decode rank reads from GPU 0
    target = Target([_inst("prefill", 1, device="cuda:0", cuda_visible_devices="0"),
                     _inst("decode", 2, device="cuda:0", cuda_visible_devices="2,3", tensor_parallel_size=2)], True)
    assert _pairs(target, Options()) == ([("0", "2"), ("0", "3")], None)
    # same TP: rank to rank only
    target = Target([_inst("prefill", 1, device="cuda:0", cuda_visible_devices="0,1", tensor_parallel_size=2),
                     _inst("decode", 2, device="cuda:0", cuda_visible_devices="2,3", tensor_parallel_size=2)], True)
    assert _pairs(target, Options()) == ([("0", "2"), ("1", "3")], None)
