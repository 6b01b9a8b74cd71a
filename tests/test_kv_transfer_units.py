"""Unit tests of the KV transfer layer's pure parts: config, params, leases, descriptors, side channel, metrics.

No NIXL here: these run everywhere and fast. Time-dependent logic uses an injected clock.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.api.pd import build_producer_params, parse_remote_prefill_params
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.compat import PROTOCOL_VERSION, compat_differences, make_compat
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.errors import (
    InvalidKVTransferParams,
    SideChannelError,
    SideChannelRefused,
    SideChannelTimeout,
)
from pdserve.kv_transfer.leases import ClaimRefused, LeaseTable
from pdserve.kv_transfer.metrics import TransferMetrics
from pdserve.kv_transfer.pool import (
    RemotePool,
    coalesce_block_runs,
    descriptor_arrays,
    pretouch,
    region_of,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- config ---------------------------------------------------------------------------------------------


def test_config_defaults_and_env_fallbacks() -> None:
    cfg = KVTransferConfig.from_json('{"kv_connector":"NixlConnector","kv_role":"kv_producer"}', env={})
    assert cfg.kv_load_failure_policy == "fail" and cfg.backends == ("UCX",)
    assert cfg.kv_lease_duration == 30.0 and cfg.heartbeat_interval_s == 5.0
    assert cfg.transfer_timeout_s == 2.0 and cfg.side_channel_port == 5600
    assert cfg.side_channel_host == "127.0.0.1" and cfg.is_producer and not cfg.is_consumer
    assert len(cfg.engine_id) == 36  # uuid4

    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "localhost", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5711"}
    cfg = KVTransferConfig.from_json(
        {
            "kv_connector": "NixlPullConnector",
            "kv_role": "kv_both",
            "engine_id": "e1",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kv_lease_duration": 12,
                "backends": ["UCX"],
                "transfer_timeout_s": 1.5,
            },
        },
        env=env,
    )
    assert (cfg.side_channel_host, cfg.side_channel_port, cfg.bind_host) == ("localhost", 5711, "127.0.0.1")
    assert cfg.is_producer and cfg.is_consumer and cfg.engine_id == "e1"
    assert cfg.kv_lease_duration == 12.0 and cfg.transfer_timeout_s == 1.5
    # Explicit arguments win over the environment.
    cfg = KVTransferConfig.from_json(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
        side_channel_host="10.0.0.5",
        side_channel_port=6000,
        env=env,
    )
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("10.0.0.5", 6000)


@pytest.mark.parametrize(
    ("raw", "env", "message"),
    [
        ('{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}', {}, "kv_connector must be one of"),
        ('{"kv_connector":"NixlPushConnector","kv_role":"kv_both"}', {}, "push mode"),
        ('{"kv_connector":"NixlConnector"}', {}, "kv_role must be one of"),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"retry"}',
            {},
            "policy",
        ),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"tpu"}',
            {},
            "kv_buffer_device",
        ),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"kv_lease_duration":-1}}',
            {},
            "kv_lease_duration must be > 0",
        ),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"backends":"UCX"}}',
            {},
            "backends",
        ),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
            {"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"},
            "VLLM_NIXL",
        ),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
            {"VLLM_NIXL_SIDE_CHANNEL_PORT": "70000"},
            "0..65535",
        ),
        ("{not json", {}, "not valid JSON"),
    ],
)
def test_config_errors_are_clear(raw: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_json(raw, env=env)


# ---- params ---------------------------------------------------------------------------------------------


def _params(**overrides: Any) -> dict[str, Any]:
    params = build_producer_params(
        request_id="r1",
        block_ids=[4, 5, 9],
        num_tokens=10,
        num_cached_tokens=0,
        engine_id="eng",
        host="127.0.0.1",
        port=5600,
        generation=7,
        lease_duration_s=30.0,
    )
    params.update(overrides)
    return params


def test_producer_params_round_trip() -> None:
    parsed = parse_remote_prefill_params(_params())
    assert parsed.remote_block_ids == (4, 5, 9) and parsed.generation == 7
    assert parsed.address == ("127.0.0.1", 5600) and parsed.remote_request_id == "r1"
    # vLLM schema v1 sent a flat list.
    assert parse_remote_prefill_params(_params(remote_block_ids=[1, 2])).remote_block_ids == (1, 2)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("nope", "expected a JSON object"),
        ({"do_remote_prefill": False}, "do_remote_prefill"),
        (
            {"do_remote_prefill": True, "remote_block_ids": [[1]]},
            "missing remote_engine_id, remote_request_id",
        ),
        (_params(remote_port=None), "missing remote_port"),
        (_params(remote_port="5600"), "remote_port"),
        (_params(remote_port=0), "remote_port"),
        (_params(remote_block_ids=[[1], [2]]), "2 KV-cache groups"),
        (_params(remote_block_ids=[[1, -2]]), "non-negative"),
        (_params(remote_block_ids=[["a"]]), "non-negative"),
        (_params(remote_block_ids=[]), "non-empty"),
        (_params(tp_size=2), "tp_size=2"),
        (_params(remote_host=""), "remote_host"),
        (_params(transfer_mode="push"), "push"),
        (_params(remote_registration_generation="7"), "generation"),
    ],
)
def test_malformed_params_are_rejected_with_a_message(params: Any, message: str) -> None:
    with pytest.raises(InvalidKVTransferParams, match=message):
        parse_remote_prefill_params(params)
    assert issubclass(InvalidKVTransferParams, ValueError)


# ---- leases ---------------------------------------------------------------------------------------------


def _table(**kw: Any) -> tuple[LeaseTable, FakeClock, list[str], list[str]]:
    clock = FakeClock()
    expired: list[str] = []
    late: list[str] = []
    table = LeaseTable(
        10.0, claim_margin_s=1.0, clock=clock, on_expired=expired.append, on_late=late.append, **kw
    )
    return table, clock, expired, late


def test_lease_claim_release_frees_and_reports_held() -> None:
    table, clock, expired, _ = _table()
    table.hold("a", [1, 2], 20)
    assert len(table) == 1
    blocks, token = table.claim("a", timeout_s=2.0)
    assert blocks == (1, 2) and table.num_claimed == 1
    with pytest.raises(ClaimRefused) as exc:
        table.claim("a", 2.0)
    assert exc.value.reason == "already_claimed"
    assert table.release("a", "wrong-token") is False and len(table) == 1  # someone else's release: ignored
    clock.now += 2.5  # past the read timeout but within the margin; the reaper has not freed it
    assert table.reap() == []
    assert table.release("a", token) is True
    assert table.poll_released() == ["a"] and table.poll_released() == []
    assert len(table) == 0 and table.num_claimed == 0 and expired == []


def test_lease_expiry_and_late_events_are_counted_once() -> None:
    table, clock, expired, late = _table()
    table.hold("a", [1], 4)
    clock.now += 9.9
    assert table.reap() == []
    clock.now += 0.2
    assert table.reap() == ["a"] and expired == ["a"] and table.num_expired == 1
    assert table.poll_released() == ["a"]
    with pytest.raises(ClaimRefused) as exc:
        table.claim("a", 2.0)
    assert exc.value.reason == "expired"
    assert table.release("a", "t") is False
    table.note_read_notification("a")
    assert late == ["a"] and table.num_after_expiry == 1
    with pytest.raises(ClaimRefused) as exc:
        table.claim("never-held", 2.0)
    assert exc.value.reason == "unknown"


def test_claim_after_expiry_is_refused_even_before_the_reaper_runs() -> None:
    table, clock, expired, _ = _table()
    table.hold("a", [1], 4)
    clock.now += 10.0
    with pytest.raises(ClaimRefused, match="expired"):
        table.claim("a", 2.0)
    assert expired == ["a"] and table.poll_released() == ["a"]


def test_claimed_lease_past_its_deadline_is_reaped_and_release_says_not_held() -> None:
    table, clock, expired, late = _table()
    table.hold("a", [3], 4)
    _, token = table.claim("a", timeout_s=2.0)
    clock.now += 3.01  # timeout + margin
    assert table.reap() == ["a"] and expired == ["a"]
    assert table.release("a", token) is False and late == ["a"]


def test_heartbeat_extends_to_two_thirds_and_never_shortens() -> None:
    table, clock, _, _ = _table()
    table.hold("a", [1], 4)  # expires at 1010
    clock.now += 1.0
    assert table.heartbeat(["a", "zz"]) == ["zz"]
    assert table.get("a").expires_at == 1010.0  # max(1010, 1001 + 6.67)
    clock.now += 8.0
    table.heartbeat(["a"])
    assert table.get("a").expires_at == pytest.approx(1009.0 + 10 * 2 / 3)
    clock.now += 2.0  # 1011: past the original expiry, kept alive by the heartbeat
    assert table.reap() == []


def test_abort_frees_only_unclaimed_leases() -> None:
    table, _, expired, _ = _table()
    table.hold("a", [1], 4)
    table.hold("b", [2], 4)
    table.claim("b", 2.0)
    assert table.abort("a") is True and table.abort("b") is False and table.abort("zz") is False
    assert table.poll_released() == ["a"] and expired == []
    with pytest.raises(ValueError, match="already holds"):
        table.hold("b", [2], 4)


# ---- pool and descriptors -------------------------------------------------------------------------------


def test_coalescing_requires_both_sides_consecutive() -> None:
    assert coalesce_block_runs([1, 2, 3], [7, 8, 9]) == [(1, 7, 3)]
    assert coalesce_block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert coalesce_block_runs([5, 4], [1, 2]) == [(5, 1, 1), (4, 2, 1)]
    # lockstep-descending runs are one contiguous region on each side, mapped block to block
    assert coalesce_block_runs([9, 8, 7], [4, 3, 2]) == [(7, 2, 3)]
    assert coalesce_block_runs([9, 8, 7, 20, 21], [4, 3, 2, 5, 6]) == [(7, 2, 3), (20, 5, 2)]
    assert coalesce_block_runs([3, 2, 5], [3, 4, 5]) == [(3, 3, 1), (2, 4, 1), (5, 5, 1)]
    assert coalesce_block_runs([], []) == []
    with pytest.raises(ValueError):
        coalesce_block_runs([1], [1, 2])


def test_descriptor_addresses_span_whole_blocks() -> None:
    pool = np.zeros((8, 2, 2, 4, 2, 8), dtype=np.float16)
    region = region_of(pool)
    assert region.block_bytes == 512 and region.mem_type == "DRAM" and region.dtype == "float16"
    remote = RemotePool(
        base_addr=1 << 20, length=16 * 512, mem_type="DRAM", device_id=0, block_bytes=512, num_blocks=16
    )
    local_d, remote_d = descriptor_arrays(coalesce_block_runs([2, 3, 6], [10, 11, 0]), region, remote)
    assert local_d.tolist() == [[region.base_addr + 2 * 512, 1024, 0], [region.base_addr + 6 * 512, 512, 0]]
    assert remote_d.tolist() == [[(1 << 20) + 10 * 512, 1024, 0], [1 << 20, 512, 0]]


def test_region_rejects_bad_pools_and_pretouch_keeps_contents() -> None:
    with pytest.raises(ValueError, match="6-D"):
        region_of(np.zeros((4, 4)))
    with pytest.raises(ValueError, match="K and V"):
        region_of(np.zeros((4, 1, 3, 4, 1, 1)))
    with pytest.raises(ValueError, match="contiguous"):
        region_of(np.zeros((4, 1, 2, 4, 1, 2))[:, :, :, :, :, :1])
    pool = np.random.default_rng(0).standard_normal((16, 2, 2, 16, 4, 64)).astype(np.float16)
    before = pool.copy()
    pretouch(region_of(pool))
    assert np.array_equal(pool, before)


# ---- compat ---------------------------------------------------------------------------------------------


def test_compat_differences_name_the_fields() -> None:
    a = make_compat(
        model="m", dtype="torch.bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8
    )
    assert a["dtype"] == "bfloat16" and a["protocol_version"] == PROTOCOL_VERSION
    b = dict(a, block_size=32, dtype="float16")
    diffs = compat_differences(a, b, ("producer", "consumer"))
    assert diffs == ["block_size: producer=16 consumer=32", "dtype: producer='bfloat16' consumer='float16'"]
    assert compat_differences(a, dict(a)) == []


# ---- side channel ---------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Any:
    calls: list[tuple[str, dict]] = []

    def handler(op: str, msg: dict[str, Any]) -> dict[str, Any]:
        calls.append((op, msg))
        if op == "claim":
            if msg["request_id"] == "gone":
                raise SideChannelRefused("expired", "lease expired")
            return {"block_ids": [1, 2], "token": "tok"}
        if op == "heartbeat":
            return {"unknown": []}
        if op == "release":
            return {"held_throughout": "yes"}  # wrong type: the client must refuse it
        raise RuntimeError("boom")

    srv = side_channel.SideChannelServer("127.0.0.1", 0, handler)
    srv.start()
    srv.calls = calls  # type: ignore[attr-defined]
    yield srv
    srv.close()


def test_side_channel_round_trip_and_refusals(server: Any) -> None:
    port = server.port
    reply = side_channel.call(
        "127.0.0.1", port, "claim", {"request_id": "r", "generation": 1, "timeout_s": 2}, 2.0
    )
    assert reply["block_ids"] == [1, 2] and reply["token"] == "tok" and reply["ok"] is True
    assert (
        side_channel.call("localhost", port, "heartbeat", {"request_ids": ["a", "b"]}, 2.0)["unknown"] == []
    )
    with pytest.raises(SideChannelRefused) as exc:
        side_channel.call(
            "127.0.0.1", port, "claim", {"request_id": "gone", "generation": 1, "timeout_s": 2}, 2.0
        )
    assert exc.value.reason == "expired" and "lease expired" in str(exc.value)
    with pytest.raises(SideChannelRefused) as exc:
        side_channel.call("127.0.0.1", port, "abort", {"request_id": "x"}, 2.0)
    assert exc.value.reason == "internal" and "boom" in str(exc.value)
    with pytest.raises(side_channel.ProtocolError, match="held_throughout"):
        side_channel.call("127.0.0.1", port, "release", {"request_id": "x", "token": "t"}, 2.0)
    with pytest.raises(side_channel.ProtocolError, match="generation"):
        side_channel.call(
            "127.0.0.1", port, "claim", {"request_id": "r", "generation": True, "timeout_s": 2}, 2.0
        )


def _raw_exchange(port: int, data: bytes) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(data)
        decoder = side_channel.FrameDecoder()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            messages = decoder.feed(sock.recv(65536))
            if messages:
                return messages[0]
    raise AssertionError("no reply")


def test_side_channel_server_rejects_bad_input(server: Any) -> None:
    port = server.port
    reply = _raw_exchange(port, side_channel.encode_frame({"v": 99, "op": "claim"}))
    assert reply["ok"] is False and "version mismatch" in reply["error"]
    reply = _raw_exchange(port, side_channel.encode_frame({"v": PROTOCOL_VERSION, "op": "steal"}))
    assert reply["ok"] is False and "unknown op" in reply["error"]
    reply = _raw_exchange(
        port, side_channel.encode_frame({"v": PROTOCOL_VERSION, "op": "claim", "request_id": 5})
    )
    assert reply["ok"] is False and reply["reason"] == "bad_request"
    reply = _raw_exchange(port, (side_channel.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert reply["ok"] is False and "exceeds" in reply["error"]
    reply = _raw_exchange(port, b"\x00\x00\x00\x02\xc1\xc1")  # 0xc1 is never valid msgpack
    assert reply["ok"] is False and "undecodable" in reply["error"]
    # Still serving after all that.
    assert side_channel.call("127.0.0.1", port, "heartbeat", {"request_ids": []}, 2.0)["unknown"] == []
    assert [op for op, _ in server.calls] == ["heartbeat"]


class _SilentPeer:
    """Accepts connections and optionally sends fixed bytes, but never answers: a frozen producer."""

    def __init__(self, greeting: bytes = b"") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.05)  # accept() is not interrupted by close(); poll a stop flag instead
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._greeting = greeting
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            if self._greeting:
                conn.sendall(self._greeting)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.sock.close()
        for conn in self._conns:
            conn.close()


def test_side_channel_client_never_hangs() -> None:
    silent = _SilentPeer()
    try:
        t0 = time.monotonic()
        with pytest.raises(SideChannelTimeout, match="no reply to abort within 0.3s"):
            side_channel.call("127.0.0.1", silent.port, "abort", {"request_id": "x"}, 0.3)
        assert time.monotonic() - t0 < 5.0
    finally:
        silent.close()
    zmq = _SilentPeer(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")
    try:
        with pytest.raises(SideChannelError, match="ZeroMQ"):
            side_channel.call("127.0.0.1", zmq.port, "abort", {"request_id": "x"}, 2.0)
    finally:
        zmq.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(SideChannelError, match="unreachable"):
        side_channel.call("127.0.0.1", port, "abort", {"request_id": "x"}, 2.0)


def test_side_channel_port_in_use_names_the_port() -> None:
    first = side_channel.SideChannelServer("127.0.0.1", 0)
    try:
        with pytest.raises(SideChannelError, match=rf"port {first.port} on 127.0.0.1 is already in use"):
            side_channel.SideChannelServer("127.0.0.1", first.port)
    finally:
        first.close()


# ---- metrics --------------------------------------------------------------------------------------------


def test_log_line_format_and_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    metrics = TransferMetrics(model_name="m", engine="0", log_interval_s=10.0, clock=clock)
    clock.now += 11
    assert metrics.maybe_log() is None  # idle interval: no line
    metrics.record_transfer(xfer_s=0.010, post_s=0.002, nbytes=2 * 2**20, num_descriptors=4)
    metrics.record_transfer(xfer_s=0.030, post_s=0.004, nbytes=4 * 2**20, num_descriptors=8)
    metrics.record_failed_transfer()
    metrics.record_kv_expired()
    clock.now += 5
    assert metrics.maybe_log() is None  # interval not over yet
    clock.now += 6
    with caplog.at_level(logging.INFO, logger="pdserve.kv_transfer"):
        line = metrics.maybe_log()
    assert line == (
        "KV Transfer metrics: Num successful transfers=2, Avg xfer time (ms)=20.0, P90 xfer time (ms)=28.0, "
        "Avg post time (ms)=3.0, P90 post time (ms)=3.8, Avg MB per transfer=3.0, Throughput (MB/s)=150.0, "
        "Avg number of descriptors=6.0, Num failed transfers=1, Num KV expired reqs=1, Num notifs after expiry=0"
    )
    assert any(r.name == "pdserve.kv_transfer" and r.getMessage() == line for r in caplog.records)
    metrics.record_failed_notification()
    clock.now += 11
    assert metrics.maybe_log() == (
        "KV Transfer metrics: Num successful transfers=0, Avg xfer time (ms)=0, P90 xfer time (ms)=0, "
        "Avg post time (ms)=0, P90 post time (ms)=0, Avg MB per transfer=0, Throughput (MB/s)=0, "
        "Avg number of descriptors=0, Num failed transfers=1, Num KV expired reqs=0, Num notifs after expiry=0"
    )


def test_prometheus_names_labels_and_separate_registries() -> None:
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    a = TransferMetrics(model_name="llama", engine="0", registry=reg_a)
    TransferMetrics(model_name="llama", engine="0", registry=reg_b)  # no collision with `a`
    a.record_transfer(xfer_s=0.02, post_s=0.001, nbytes=3000, num_descriptors=12)
    a.record_failed_transfer()
    a.record_failed_notification()
    a.record_kv_expired()
    a.record_notification_after_expiry()
    a.set_fetch_stages(waiting_to_start=3, in_progress=1, completed_waiting=0)
    text = generate_latest(reg_a).decode()
    labels = '{engine="0",model_name="llama"}'
    for line in (
        f"vllm:nixl_xfer_time_seconds_count{labels} 1.0",
        f"vllm:nixl_post_time_seconds_count{labels} 1.0",
        f"vllm:nixl_bytes_transferred_sum{labels} 3000.0",
        f"vllm:nixl_num_descriptors_sum{labels} 12.0",
        f"vllm:nixl_num_failed_transfers_total{labels} 1.0",
        f"vllm:nixl_num_failed_notifications_total{labels} 1.0",
        f"vllm:nixl_num_kv_expired_reqs_total{labels} 1.0",
        f"vllm:nixl_num_notifications_after_expiry_total{labels} 1.0",
        'vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="llama",stage="waiting_to_start"} 3.0',
        'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="llama"} 0.0',
        'vllm:nixl_post_time_seconds_bucket{engine="0",le="0.001",model_name="llama"} 1.0',
        'vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0",model_name="llama"} 0.0',
        'vllm:nixl_num_descriptors_bucket{engine="0",le="20.0",model_name="llama"} 1.0',
    ):
        assert line in text, line


def test_connector_implements_the_engines_protocol():
    """Every member the engine calls exists on KVConnector, with the same parameters."""
    import inspect

    from pdserve.engine.kv_connector_protocol import KVConnectorProtocol
    from pdserve.kv_transfer import KVConnector

    members = [n for n in vars(KVConnectorProtocol) if not n.startswith("_")]
    assert {"can_load", "can_send", "load_failure_policy", "start_load", "poll_loads", "hold"} <= set(members)
    for name in members:
        want, got = getattr(KVConnectorProtocol, name), getattr(KVConnector, name, None)
        assert got is not None, name
        if isinstance(want, property):
            assert isinstance(got, property), name
        else:
            def params(f) -> list[str]:
                return [p for p in inspect.signature(f).parameters if p != "self"]  # validate is static

            assert params(got) == params(want), name
