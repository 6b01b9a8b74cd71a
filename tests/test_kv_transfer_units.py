"""Unit tests of the KV transfer layer's pure parts: config, params, leases, descriptors, side channel, metrics.

No NIXL here: these run everywhere and fast. Time-dependent logic uses an injected clock.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.api import pd
from pdserve.api.pd import HeldKVParams, parse_remote_prefill_params
from pdserve.kv_transfer import side_channel
from pdserve.kv_transfer.auth import (
    AEAD_NONCE_BYTES,
    REPLY,
    REQUEST,
    SEAL_OVERHEAD,
    AuthRefused,
    MessageAuth,
    ReplayGuard,
    new_nonce,
)
from pdserve.kv_transfer.compat import PROTOCOL_VERSION, compat_differences, make_compat
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.errors import (
    InvalidKVTransferParams,
    SideChannelError,
    SideChannelRefused,
    SideChannelTimeout,
)
from pdserve.kv_transfer.leases import ClaimRefused, LeaseTable
from pdserve.kv_transfer.messages import (
    Abort,
    Claim,
    ClaimReply,
    Heartbeat,
    HeartbeatReply,
    PushCancel,
    Release,
    ReleaseReply,
    Reply,
    Request,
)
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
        ('{"kv_connector":"NixlPushConnector","kv_role":"kv_both",'
         '"kv_connector_extra_config":{"bidirectional_kv_xfer":true}}', {}, "bidirectional_kv_xfer needs kv_role"),
        ('{"kv_connector":"NixlPushConnector","kv_role":"kv_both","kv_connector_extra_config":{"push_pipeline":"x"}}',
         {}, "push_pipeline must be one of"),
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
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}',
            {"VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0"},
            "would listen on 0.0.0.0 without authentication.*PDSERVE_KV_SECRET.*--insecure-side-channel",
        ),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
            {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "PDSERVE_KV_SECRET": "short"},
            "PDSERVE_KV_SECRET must be a string of at least 16",
        ),
        (
            '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":'
            '{"side_channel_secret":123}}',
            {},
            "side_channel_secret must be a string",
        ),
    ],
)
def test_config_errors_are_clear(raw: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_json(raw, env=env)


def test_side_channel_secret_and_insecure_binding(caplog: pytest.LogCaptureFixture) -> None:
    raw = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    secret = "s3cret-" + "z" * 20
    cfg = KVTransferConfig.from_json(raw, side_channel_host="0.0.0.0", env={"PDSERVE_KV_SECRET": secret})
    assert cfg.side_channel_secret == secret and secret not in repr(cfg)
    # the config key wins over the environment, is kept out of extra_config, and is warned about (argv)
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"):
        cfg = KVTransferConfig.from_json(
            {**raw, "kv_connector_extra_config": {"side_channel_secret": "k" * 16}},
            env={"PDSERVE_KV_SECRET": secret},
        )
    assert cfg.side_channel_secret == "k" * 16 and "side_channel_secret" not in cfg.extra_config
    assert "visible to every user" in caplog.text and "k" * 16 not in caplog.text
    # no secret: loopback only, unless explicitly insecure (then a warning)
    assert KVTransferConfig.from_json(raw, env={}).side_channel_secret is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"):
        cfg = KVTransferConfig.from_json(raw, side_channel_host="10.0.0.7", insecure_side_channel=True, env={})
    assert cfg.insecure_side_channel and "INSECURE" in caplog.text
    # a consumer binds nothing: no secret needed whatever the host
    assert KVTransferConfig.from_json({**raw, "kv_role": "kv_consumer"}, side_channel_host="10.0.0.7", env={})


# ---- params ---------------------------------------------------------------------------------------------


def _params(**overrides: Any) -> dict[str, Any]:
    params = HeldKVParams(
        request_id="r1",
        block_ids=(4, 5, 9),
        num_tokens=10,
        num_cached_tokens=0,
        engine_id="eng",
        host="127.0.0.1",
        port=5600,
        generation=7,
        expires_at=time.time() + 30.0,
        lease_token="tok-" + "x" * 28,
    ).to_json()
    params.update(overrides)
    return params


def test_producer_params_round_trip() -> None:
    parsed = parse_remote_prefill_params(_params())
    assert parsed.remote_block_ids == (4, 5, 9) and parsed.generation == 7
    assert parsed.address == ("127.0.0.1", 5600) and parsed.remote_request_id == "r1"
    assert parsed.lease_token == "tok-" + "x" * 28 and "tok-" not in repr(parsed)  # never logged
    assert parsed.tp_size == 1 and parse_remote_prefill_params(_params(tp_size=4)).tp_size == 4
    # vLLM schema v1 sent a flat list.
    assert parse_remote_prefill_params(_params(remote_block_ids=[1, 2])).remote_block_ids == (1, 2)


def test_held_params_wire_form_is_vllms_byte_for_byte() -> None:
    """The typed params serialise to exactly the JSON a prefill (vLLM 0.33 pull, or push) and a decode instance
    keeping a conversation (bidirectional_kv_xfer) answer: every key, in this order, with these values."""
    import dataclasses

    held = HeldKVParams(request_id="r", block_ids=(1, 2), num_tokens=9, num_cached_tokens=3, engine_id="e",
                        host="h", port=5, generation=7, expires_at=1030.0, lease_token="tok", tp_size=2)
    common = ('"remote_block_ids": [[1, 2]], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", '
              '"remote_port": 5, "remote_num_tokens": 9, "tp_size": 2, "dcp_size": 1, "pp_size": 1, ')
    assert json.dumps(held.to_json()) == (
        '{"do_remote_prefill": true, "do_remote_decode": false, ' + common + '"remote_blocks_expiry_time": null, '
        '"remote_registration_generation": 7, "transfer_mode": "pull", "remote_prefill_cached_tokens": 3, '
        '"lease_expires_at": 1030.0, "remote_lease_token": "tok"}')
    pushed = dataclasses.replace(held, push=True, first_token=pd.FirstToken(4, -0.5, 1, ((4, -0.5),)))
    assert json.dumps(pushed.to_json()) == (
        '{"do_remote_prefill": true, "do_remote_decode": false, ' + common + '"remote_blocks_expiry_time": null, '
        '"remote_registration_generation": 7, "transfer_mode": "push", "remote_prefill_cached_tokens": 3, '
        '"lease_expires_at": 1030.0, "first_token_id": 4, '
        '"first_token_logprob": {"logprob": -0.5, "rank": 1, "top": [[4, -0.5]]}}')
    history = dataclasses.replace(held, history=True, block_hashes=("ab", "cd"), block_bytes=1024)
    assert json.dumps(history.to_json()) == (
        '{"do_remote_prefill": false, "do_remote_decode": true, ' + common + '"remote_blocks_expiry_time": 1030.0, '
        '"remote_registration_generation": 7, "transfer_mode": "pull", "lease_expires_at": 1030.0, '
        '"remote_lease_token": "tok", "remote_block_hashes": ["ab", "cd"], "remote_block_bytes": 1024}')


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
        (_params(remote_block_ids=[["a"]]), r"remote_block_ids\[0\] must be a list of non-negative"),
        (_params(remote_block_ids=[1, "a"]), r"remote_block_ids must be a list of non-negative integers \(or"),
        (_params(remote_lease_token=None), "missing remote_lease_token .only a pdserve prefill"),
        (_params(remote_lease_token=5), "remote_lease_token must be a non-empty string"),
        (_params(remote_block_ids=[]), "non-empty"),
        (_params(tp_size=0), "tp_size must be a positive integer"),
        (_params(tp_size=True), "tp_size must be a positive integer"),
        (_params(tp_size=4096), "tp_size=4096 is more than"),
        (_params(pp_size=2), "pp_size=2: producers with pipeline"),
        (_params(remote_host=""), "remote_host"),
        (_params(transfer_mode="push"), "push"),
        (_params(remote_registration_generation="7"), "generation"),
    ],
)
def test_malformed_params_are_rejected_with_a_message(params: Any, message: str) -> None:
    with pytest.raises(InvalidKVTransferParams, match=message) as exc:
        parse_remote_prefill_params(params)
    assert str(exc.value).count("invalid kv_transfer_params") == 1
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
    lease = table.hold("a", [1, 2], 20)
    assert len(table) == 1 and len(lease) >= 32
    blocks, claim = table.claim("a", lease, timeout_s=2.0)
    assert blocks == (1, 2) and table.num_claimed == 1
    with pytest.raises(ClaimRefused) as exc:
        table.claim("a", lease, 2.0)
    assert exc.value.reason == "already_claimed"
    # someone else's release (a duplicate decode request holding the same params): ignored
    assert table.release("a", lease, "wrong-claim") is False and len(table) == 1
    clock.now += 2.5  # past the read timeout but within the margin; the reaper has not freed it
    assert table.reap() == []
    assert table.release("a", lease, claim) is True
    assert table.poll_released() == ["a"] and table.poll_released() == []
    assert len(table) == 0 and table.num_claimed == 0 and expired == []


def test_every_lease_op_needs_the_leases_own_token() -> None:
    table, clock, expired, _ = _table()
    lease_a = table.hold("a", [1, 2], 20)
    lease_b = table.hold("b", [3], 4)
    assert lease_a != lease_b
    for call in (
        lambda: table.claim("a", lease_b, 2.0),
        lambda: table.claim("a", "", 2.0),
        lambda: table.abort("a", lease_b),
    ):
        with pytest.raises(ClaimRefused) as exc:
            call()
        assert exc.value.reason == "bad_token" and lease_a not in str(exc.value)
    # a heartbeat with the wrong token neither extends nor affects the honest pairs of the same batch
    clock.now += 5.0
    assert table.heartbeat([("a", lease_b), ("b", lease_b), ("zz", "x")]) == (["zz"], ["a"])
    assert table.get("a").expires_at == 1010.0 and table.get("b").expires_at == pytest.approx(1005 + 20 / 3)
    _, claim = table.claim("a", lease_a, 2.0)
    with pytest.raises(ClaimRefused, match="does not match") as exc:
        table.release("a", lease_b, claim)
    assert table.get("a") is not None and table.release("a", lease_a, claim) is True
    # an expired lease: only its own token learns that it expired
    clock.now += 20.0
    assert table.reap() == ["b"] and expired == ["b"]
    with pytest.raises(ClaimRefused) as exc:
        table.claim("b", lease_a, 2.0)
    assert exc.value.reason == "bad_token"
    with pytest.raises(ClaimRefused) as exc:
        table.claim("b", lease_b, 2.0)
    assert exc.value.reason == "expired"


def test_lease_expiry_and_late_events_are_counted_once() -> None:
    table, clock, expired, late = _table()
    lease = table.hold("a", [1], 4)
    clock.now += 9.9
    assert table.reap() == []
    clock.now += 0.2
    assert table.reap() == ["a"] and expired == ["a"] and table.num_expired == 1
    assert table.poll_released() == ["a"]
    with pytest.raises(ClaimRefused) as exc:
        table.claim("a", lease, 2.0)
    assert exc.value.reason == "expired"
    assert table.release("a", lease, "t") is False
    table.note_read_notification("a")
    assert late == ["a"] and table.num_after_expiry == 1
    with pytest.raises(ClaimRefused) as exc:
        table.claim("never-held", lease, 2.0)
    assert exc.value.reason == "unknown"


def test_claim_after_expiry_is_refused_even_before_the_reaper_runs() -> None:
    table, clock, expired, _ = _table()
    lease = table.hold("a", [1], 4)
    clock.now += 10.0
    with pytest.raises(ClaimRefused, match="expired"):
        table.claim("a", lease, 2.0)
    assert expired == ["a"] and table.poll_released() == ["a"]


def test_claimed_lease_past_its_deadline_is_reaped_and_release_says_not_held() -> None:
    table, clock, expired, late = _table()
    lease = table.hold("a", [3], 4)
    _, claim = table.claim("a", lease, timeout_s=2.0)
    clock.now += 3.01  # timeout + margin
    assert table.reap() == ["a"] and expired == ["a"]
    assert table.release("a", lease, claim) is False and late == ["a"]


def test_heartbeat_extends_to_two_thirds_and_never_shortens() -> None:
    table, clock, _, _ = _table()
    lease = table.hold("a", [1], 4)  # expires at 1010
    clock.now += 1.0
    assert table.heartbeat([("a", lease), ("zz", "t")]) == (["zz"], [])
    assert table.get("a").expires_at == 1010.0  # max(1010, 1001 + 6.67)
    clock.now += 8.0
    table.heartbeat([("a", lease)])
    assert table.get("a").expires_at == pytest.approx(1009.0 + 10 * 2 / 3)
    clock.now += 2.0  # 1011: past the original expiry, kept alive by the heartbeat
    assert table.reap() == []


def test_abort_frees_only_unclaimed_leases() -> None:
    table, _, expired, _ = _table()
    lease_a = table.hold("a", [1], 4)
    lease_b = table.hold("b", [2], 4)
    table.claim("b", lease_b, 2.0)
    assert table.abort("a", lease_a) is True and table.abort("b", lease_b) is False
    assert table.abort("zz", lease_a) is False
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


def test_a_cpu_head_major_pool_and_a_gpu_token_major_pool_are_refused() -> None:
    """A CPU float pool keeps its regions head-major, a GPU pool token-major: the same bytes read as the
    other order would be garbage KV, so the handshake refuses the pair, naming the layouts."""
    from pdserve.kv_transfer.compat import HEAD_MAJOR_LAYOUT, POOL_LAYOUT, check_compat
    from pdserve.kv_transfer.errors import CompatibilityError

    common = dict(model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
    gpu, cpu = make_compat(**common), make_compat(**common, kv_layout=HEAD_MAJOR_LAYOUT)
    assert gpu["kv_layout"] == POOL_LAYOUT
    with pytest.raises(CompatibilityError, match="kv_layout: ours='block,layer,kv,token,head,dim' "
                                                 "theirs='block,layer,kv,head,token,dim'"):
        check_compat(gpu, cpu, peer="producer")


# ---- side channel ---------------------------------------------------------------------------------------


ENGINE = "eng-under-test"


@pytest.fixture
def server() -> Any:
    calls: list[tuple[str, Request[Reply]]] = []
    refused: list[str] = []

    def handler(request: Request[Reply], peer: str) -> Reply:
        calls.append((request.op, request))
        match request:
            case Claim(request_id="gone"):
                raise SideChannelRefused("expired", "lease expired")
            case Claim():
                return ClaimReply(block_ids=(1, 2), claim_token="tok")
            case Heartbeat():
                return HeartbeatReply(unknown=())
            case Release():
                return ReleaseReply(held_throughout="yes")  # type: ignore[arg-type]  # wrong type: the client must refuse it
            case PushCancel():
                return HeartbeatReply(unknown=())  # not a push_cancel's reply: the server must not send it
        raise RuntimeError("boom")

    srv = side_channel.SideChannelServer("127.0.0.1", 0, handler, engine_id=ENGINE, on_refused=refused.append)
    srv.start()
    srv.calls = calls  # type: ignore[attr-defined]
    srv.refused = refused  # type: ignore[attr-defined]
    yield srv
    srv.close()


CLAIM = Claim(request_id="r", lease_token="lt", generation=1, timeout_s=2)
HEARTBEAT = Heartbeat(request_ids=(), lease_tokens=())


def test_side_channel_round_trip_and_refusals(server: Any) -> None:
    port = server.port
    reply = side_channel.call("127.0.0.1", port, CLAIM, 2.0, to=ENGINE)
    assert isinstance(reply, ClaimReply) and reply.block_ids == (1, 2) and reply.claim_token == "tok" and reply.ok
    hb = Heartbeat(request_ids=("a", "b"), lease_tokens=("x", "y"))
    assert side_channel.call("localhost", port, hb, 2.0, to=ENGINE).unknown == ()
    with pytest.raises(SideChannelRefused) as exc:
        side_channel.call("127.0.0.1", port, msgspec.structs.replace(CLAIM, request_id="gone"), 2.0, to=ENGINE)
    assert exc.value.reason == "expired" and "lease expired" in str(exc.value)
    with pytest.raises(SideChannelRefused) as exc:
        side_channel.call("127.0.0.1", port, Abort(request_id="x", lease_token="t"), 2.0, to=ENGINE)
    assert exc.value.reason == "internal" and "boom" in str(exc.value)
    with pytest.raises(side_channel.ProtocolError, match="held_throughout"):
        release = Release(request_id="x", lease_token="t", claim_token="c")
        side_channel.call("127.0.0.1", port, release, 2.0, to=ENGINE)
    # a handler answering with another op's reply type is the producer's bug: refused as internal, never sent
    with pytest.raises(SideChannelRefused) as exc:
        side_channel.call("127.0.0.1", port, PushCancel(push_key="k"), 2.0, to=ENGINE)
    assert exc.value.reason == "internal" and "PushStateReply" in str(exc.value)
    # a request of the wrong type fails at the caller, as the producer would refuse it
    with pytest.raises(side_channel.ProtocolError, match="generation"):
        side_channel.call("127.0.0.1", port, msgspec.structs.replace(CLAIM, generation=True), 2.0, to=ENGINE)
    # a message for another producer (e.g. replayed from one) is refused before the handler sees it
    with pytest.raises(SideChannelRefused) as exc:
        side_channel.call("127.0.0.1", port, CLAIM, 2.0, to="someone-else")
    assert exc.value.reason == "wrong_engine"
    assert [op for op, _ in server.calls] == ["claim", "heartbeat", "claim", "abort", "release", "push_cancel"]
    assert server.refused == ["expired", "internal", "internal", "wrong_engine"]


def _raw_exchange(port: int, data: bytes) -> dict[str, Any]:
    """Send raw bytes, return the reply's inner message (with the envelope's mac under "_mac")."""
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(data)
        decoder = side_channel.FrameDecoder()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            frames = decoder.feed(sock.recv(65536))
            if frames:
                envelope = msgpack.unpackb(frames[0])
                assert envelope["v"] == PROTOCOL_VERSION
                return {**msgpack.unpackb(envelope["msg"]), "_mac": envelope.get("mac")}
    raise AssertionError("no reply")


def _envelope(msg: Any, *, v: int = PROTOCOL_VERSION, mac: bytes | None = None) -> bytes:
    payload = msg if isinstance(msg, bytes) else msgpack.packb(msg)
    return side_channel.encode_frame(msgpack.packb({"v": v, "msg": payload, "mac": mac}))


def _request(op: str, **fields: Any) -> dict[str, Any]:
    return {"op": op, "to": ENGINE, "ts": time.time(), "nonce": new_nonce(), **fields}


def test_side_channel_server_rejects_bad_input(server: Any) -> None:
    port = server.port
    reply = _raw_exchange(port, side_channel.encode_frame(msgpack.packb({"v": 1, "op": "claim"})))  # protocol 1
    assert reply["ok"] is False and "version mismatch" in reply["error"]
    reply = _raw_exchange(port, _envelope(_request("steal")))
    assert reply["ok"] is False and "unknown op" in reply["error"]
    reply = _raw_exchange(port, _envelope(_request("claim", request_id=5)))
    assert reply["ok"] is False and reply["reason"] == "bad_request"
    reply = _raw_exchange(port, (side_channel.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert reply["ok"] is False and "exceeds" in reply["error"]
    reply = _raw_exchange(port, b"\x00\x00\x00\x02\xc1\xc1")  # 0xc1 is never valid msgpack
    assert reply["ok"] is False and "undecodable" in reply["error"]
    reply = _raw_exchange(port, _envelope(b"\xc1"))
    assert reply["ok"] is False and "undecodable message" in reply["error"]
    # Still serving after all that.
    assert side_channel.call("127.0.0.1", port, HEARTBEAT, 2.0, to=ENGINE).unknown == ()
    assert [op for op, _ in server.calls] == ["heartbeat"]
    assert server.refused == ["bad_request"] * 6


SECRET = "unit-test-secret-" + "q" * 16


@pytest.fixture
def auth_server() -> Any:
    calls: list[str] = []
    refused: list[str] = []

    def handler(request: Request[Reply], peer: str) -> Reply:
        calls.append(request.op)
        assert isinstance(request, Heartbeat)
        return HeartbeatReply(unknown=request.request_ids)

    srv = side_channel.SideChannelServer(
        "127.0.0.1", 0, handler, engine_id=ENGINE, auth=MessageAuth(SECRET), on_refused=refused.append
    )
    srv.start()
    srv.calls = calls  # type: ignore[attr-defined]
    srv.refused = refused  # type: ignore[attr-defined]
    yield srv
    srv.close()


def test_authenticated_side_channel_refuses_unsigned_forged_and_replayed_messages(
    auth_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    port, auth = auth_server.port, MessageAuth(SECRET)
    hb = Heartbeat(request_ids=("a",), lease_tokens=("t",))
    assert side_channel.call("127.0.0.1", port, hb, 2.0, to=ENGINE, auth=auth).unknown == ("a",)
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"):
        # no secret, a wrong secret: refused, and the refusal reveals nothing about what would be accepted
        for wrong in (None, MessageAuth("another-secret-" + "q" * 16)):
            with pytest.raises(SideChannelError) as exc:
                side_channel.call("127.0.0.1", port, hb, 2.0, to=ENGINE, auth=wrong)
            if wrong is None:
                assert isinstance(exc.value, SideChannelRefused) and exc.value.reason == "unauthenticated"
                assert "requires the deployment secret" in str(exc.value) and SECRET not in str(exc.value)
            else:  # its own check fails first: the reply is not signed with *its* secret
                assert "not signed with this deployment's secret" in str(exc.value)
        # a captured signed request, replayed verbatim
        request = _request("heartbeat", request_ids=["a"], lease_tokens=["t"])
        payload = msgpack.packb(request)
        frame = _envelope(payload, mac=auth.sign(REQUEST, payload))
        assert _raw_exchange(port, frame)["ok"] is True
        replayed = _raw_exchange(port, frame)
        assert replayed["ok"] is False and replayed["reason"] == "replay"
        # a tampered one (the signature covers every byte)
        tampered = msgpack.packb({**request, "nonce": new_nonce(), "request_ids": ["b"]})
        reply = _raw_exchange(port, _envelope(tampered, mac=auth.sign(REQUEST, payload)))
        assert reply["reason"] == "unauthenticated"
        # an old one, signed properly
        old = msgpack.packb({**request, "nonce": new_nonce(), "ts": time.time() - 3600})
        reply = _raw_exchange(port, _envelope(old, mac=auth.sign(REQUEST, old)))
        assert reply["reason"] == "stale"
        # a reply can never be passed off as a request (direction labels)
        reply = _raw_exchange(port, _envelope(payload, mac=auth.sign(REPLY, payload)))
        assert reply["reason"] == "unauthenticated"
    assert auth_server.calls == ["heartbeat", "heartbeat"]
    assert sorted(auth_server.refused) == sorted(
        ["unauthenticated", "unauthenticated", "replay", "unauthenticated", "stale", "unauthenticated"]
    )
    assert "KV side channel refused heartbeat" in caplog.text and "(replay)" in caplog.text
    # every refusal reply is itself signed, so a consumer with the secret can trust the reason it reads
    assert auth.verify(REPLY, msgpack.packb({k: v for k, v in replayed.items() if k != "_mac"}), replayed["_mac"])


def test_consumer_with_a_secret_refuses_unsigned_and_misdirected_replies(server: Any) -> None:
    # The producer has no secret: its replies are unsigned, so a consumer with one must not believe them.
    with pytest.raises(SideChannelError, match="not signed with this deployment's secret"):
        side_channel.call("127.0.0.1", server.port, HEARTBEAT, 2.0, to=ENGINE, auth=MessageAuth(SECRET))
    # A signed reply that answers another request (another nonce) is refused too.
    auth = MessageAuth(SECRET)
    payload = msgpack.packb({"re": new_nonce(), "ok": True, "unknown": []})
    envelope = msgpack.packb({"v": PROTOCOL_VERSION, "msg": payload, "mac": auth.sign(REPLY, payload)})
    with pytest.raises(side_channel.ProtocolError, match="answers another request"):
        side_channel.open_reply(envelope, HEARTBEAT, new_nonce(), "test", auth)


def test_sealed_metadata_needs_the_secret_nonce_generation_and_rank() -> None:
    auth, data, nonce = MessageAuth(SECRET), bytes(range(256)) * 9 + b"\x00tail", new_nonce()
    sealed = auth.conceal(data, nonce, 17)
    assert len(sealed) == len(data) + SEAL_OVERHEAD and data not in sealed
    assert auth.reveal(sealed, nonce, 17) == data
    # Sealing twice never repeats an AEAD nonce, so the two ciphertexts differ.
    assert auth.conceal(data, nonce, 17) != sealed
    # Opened for another request, another producer incarnation, or with another secret: refused, never garbage.
    for opener, n, gen in ((auth, nonce, 18), (auth, new_nonce(), 17),
                           (MessageAuth("another-secret-" + "q" * 16), nonce, 17)):
        with pytest.raises(AuthRefused, match="fails authentication"):
            opener.reveal(sealed, n, gen)
    # Any flipped bit (AEAD nonce, ciphertext or tag), a truncation, or an appended byte is refused.
    for at in (0, AEAD_NONCE_BYTES, len(sealed) // 2, len(sealed) - 1):
        tampered = bytearray(sealed)
        tampered[at] ^= 0x01
        with pytest.raises(AuthRefused, match="fails authentication"):
            auth.reveal(bytes(tampered), nonce, 17)
    for bad in (sealed[:-1], sealed + b"\x00"):
        with pytest.raises(AuthRefused, match="fails authentication"):
            auth.reveal(bad, nonce, 17)
    with pytest.raises(AuthRefused, match="too short"):
        auth.reveal(sealed[: SEAL_OVERHEAD - 1], nonce, 17)
    # Ranks' parts are bound to their index: swapping two ranks' sealed metadata is refused.
    parts = auth.seal_parts([b"rank0-metadata", b"rank1-metadata"], nonce, 3)
    assert auth.open_parts(parts, nonce, 3) == [b"rank0-metadata", b"rank1-metadata"]
    with pytest.raises(AuthRefused, match="sealed part 0"):
        auth.open_parts(parts[::-1], nonce, 3)
    assert auth.reveal(auth.conceal(b"", nonce, 1), nonce, 1) == b""


def test_replay_guard_window_memory_and_restart_floor() -> None:
    clock = FakeClock()
    guard = ReplayGuard(30.0, clock=clock, max_nonces=3)
    nonces = [new_nonce() for _ in range(5)]
    guard.check(clock.now, nonces[0])
    with pytest.raises(AuthRefused, match="already received"):
        guard.check(clock.now, nonces[0])
    for bad_ts in (clock.now - 31, clock.now + 31, float("nan")):
        with pytest.raises(AuthRefused) as exc:
            guard.check(bad_ts, nonces[1])
        assert exc.value.reason == "stale"
    # from before this producer started (a message captured before a restart): refused even within the skew
    with pytest.raises(AuthRefused, match="before it started"):
        guard.check(clock.now - 10, nonces[1])
    clock.now += 40  # nonce 0's timestamp has left the window: forgotten, and its timestamp is refused anyway
    guard.check(clock.now, nonces[1])
    assert len(guard) == 1
    guard.check(clock.now, nonces[2])
    guard.check(clock.now, nonces[3])
    with pytest.raises(AuthRefused) as exc:  # bounded memory: beyond it, refuse rather than forget early
        guard.check(clock.now, nonces[4])
    assert exc.value.reason == "busy"


def test_refusal_log_is_rate_limited_but_counts_everything(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[str] = []
    clock = FakeClock()
    log = side_channel._RefusalLog(counted.append, clock=clock)
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"):
        for _ in range(50):
            log.note("unauthenticated", "10.0.0.9:4242", "claim", "no")
        clock.now += 11
        log.note("unauthenticated", "10.0.0.9:4242", "claim", "no")
    lines = [r.getMessage() for r in caplog.records]
    assert len(counted) == 51 and len(lines) == 2
    assert "10.0.0.9:4242" in lines[0] and "and 49 more 'unauthenticated' refusals" in lines[1]


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


ABORT = Abort(request_id="x", lease_token="t")


def test_side_channel_client_never_hangs() -> None:
    silent = _SilentPeer()
    try:
        t0 = time.monotonic()
        with pytest.raises(SideChannelTimeout, match="no reply to abort within 0.3s"):
            side_channel.call("127.0.0.1", silent.port, ABORT, 0.3, to=ENGINE)
        assert time.monotonic() - t0 < 5.0
    finally:
        silent.close()
    zmq = _SilentPeer(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")
    try:
        with pytest.raises(SideChannelError, match="ZeroMQ"):
            side_channel.call("127.0.0.1", zmq.port, ABORT, 2.0, to=ENGINE)
    finally:
        zmq.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(SideChannelError, match="unreachable"):
        side_channel.call("127.0.0.1", port, ABORT, 2.0, to=ENGINE)


def test_side_channel_port_in_use_names_the_port() -> None:
    first = side_channel.SideChannelServer("127.0.0.1", 0, engine_id=ENGINE)
    try:
        with pytest.raises(SideChannelError, match=rf"port {first.port} on 127.0.0.1 is already in use"):
            side_channel.SideChannelServer("127.0.0.1", first.port, engine_id=ENGINE)
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
    """Every member the engine calls exists on KVConnector and on each role it exposes (the consumer, the
    producer), with the same parameters; each transfer a consumer composes (pull, push) has every member the
    consumer calls."""
    import inspect

    from pdserve.engine.pd.connector_protocol import KVConnectorProtocol, KVConsumerRole, KVProducerRole
    from pdserve.kv_transfer import KVConnector
    from pdserve.kv_transfer.consumer import KVConsumer, LoadSink, LoadTransfer
    from pdserve.kv_transfer.producer import KVProducer
    from pdserve.kv_transfer.pull_reader import PullReader
    from pdserve.kv_transfer.push_receiver import PushReceiver

    def params(f) -> list[str]:
        return [p for p in inspect.signature(f).parameters if p != "self"]

    def check(protocol: type, impl: type) -> list[str]:
        members = [n for n in vars(protocol) if not n.startswith("_")]
        for name in members:
            want, got = getattr(protocol, name), getattr(impl, name, None)
            assert got is not None, (impl, name)
            if isinstance(want, property):
                assert isinstance(got, property), (impl, name)
            else:
                assert params(got) == params(want), (impl, name)
        return members

    members = check(KVConnectorProtocol, KVConnector)
    assert {"can_load", "can_send", "load_failure_policy", "keeps_history"} <= set(members)
    assert set(KVConnectorProtocol.__annotations__) == {"consumer", "producer"}  # the roles, as attributes
    assert {"parse", "start_load", "poll_loads"} <= set(check(KVConsumerRole, KVConsumer))
    assert {"claimed", "report", "check_digests"} <= set(check(LoadSink, KVConsumer))
    for transfer in (PullReader, PushReceiver):
        assert {"parse", "start", "keep_alive", "let_go"} <= set(check(LoadTransfer, transfer))
    assert {"parse_prefill_leg", "hold", "hold_history"} <= set(check(KVProducerRole, KVProducer))


def test_side_channel_host_defaults_to_the_servers_own_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdserve serve --host ADDR` advertises ADDR for its side channel (another host cannot dial loopback);
    an explicit --side-channel-host or VLLM_NIXL_SIDE_CHANNEL_HOST wins; a wildcard --host keeps the default."""
    from pdserve.server.kv import parse_kv_transfer_config

    raw = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.setenv("PDSERVE_KV_SECRET", "s" * 32)

    def host(http_host: str | None, explicit: str | None = None) -> str:
        return parse_kv_transfer_config(raw, explicit, None, False, http_host).side_channel_host

    assert host("10.1.2.3") == "10.1.2.3"
    assert host("10.1.2.3", "10.9.9.9") == "10.9.9.9"
    assert host("0.0.0.0") == host(None) == host("localhost") == "127.0.0.1"
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.7.7.7")
    assert host("10.1.2.3") == "10.7.7.7"
