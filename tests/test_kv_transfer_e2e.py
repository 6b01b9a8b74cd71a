"""KV connector end to end: real NIXL DRAM transfers between real producer and consumer processes.

Each peer is a `spawn` process running one KVConnector and obeying commands sent over a pipe; the test
process only drives them and compares bytes. Every wait is bounded and every process is stopped by PID.
Tests that need no process boundary (lease timing, compatibility, restart, kv_both) run their connectors
in the test process (`LocalPeer`) to save the spawn cost; signals (SIGKILL/SIGSTOP) always hit a real child.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.kv_transfer.errors import NixlUnavailableError
from pdserve.kv_transfer.nixl_agent import load_nixl

try:
    load_nixl()
except NixlUnavailableError as exc:
    pytest.skip(f"NIXL not importable: {exc}", allow_module_level=True)

# Small pool: 48 blocks x [2 layers, K/V, 4 tokens, 2 heads, 16 dims] float16 = 1 KiB per block.
SHAPE = (48, 2, 2, 4, 2, 16)
BLOCK_SIZE = SHAPE[3]
CALL_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------------------------------------
# the peer process


def _make_pool(spec: dict[str, Any]) -> Any:
    shape = spec.get("shape", SHAPE)
    seed = spec.get("seed", 0)
    if spec.get("torch"):
        import torch

        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16).contiguous()
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=np.float32).astype(spec.get("dtype", "float16"))


def _block_bytes(pool: Any, ids: list[int]) -> bytes:
    if hasattr(pool, "data_ptr"):
        return pool[ids].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
    return pool[ids].tobytes()


def _build_connector(spec: dict[str, Any]) -> tuple[Any, Any]:
    from pdserve.kv_transfer import KVConnector, KVTransferConfig, make_compat

    pool = _make_pool(spec)
    shape = tuple(pool.shape)
    compat = make_compat(
        model=spec.get("model", "tiny-test-model"),
        dtype=str(pool.dtype),
        block_size=shape[3],
        num_layers=shape[1],
        num_kv_heads=shape[4],
        head_dim=shape[5],
    )
    config = KVTransferConfig.from_json(
        {
            "kv_connector": "NixlConnector",
            "kv_role": spec["role"],
            "engine_id": spec["engine_id"],
            "kv_connector_extra_config": spec.get("extra", {}),
        },
        side_channel_host="127.0.0.1",
        side_channel_port=spec.get("port", 0),
    )
    return KVConnector(config, pool, compat, shape[3]), pool


def _peer_main(conn: Any, spec: dict[str, Any]) -> None:
    for key, value in spec.get("env", {}).items():
        os.environ[key] = value
    try:
        connector, pool = _build_connector(spec)
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid(), "port": connector.side_channel_port}))
    released: set[str] = set()
    results: dict[str, Any] = {}
    try:
        while True:
            cmd, args = conn.recv()
            try:
                if cmd == "stop":
                    conn.send(("ok", None))
                    break
                conn.send(("ok", _peer_command(connector, pool, cmd, args, released, results)))
            except Exception as exc:  # report to the driver, keep serving
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
    finally:
        connector.shutdown()


def _load_params(connector: Any, params: dict[str, Any]) -> Any:
    """Params as a decode leg sends them, parsed once by the consumer (as the engine does)."""
    from pdserve.api.pd import KVTransferParams

    return connector.consumer.parse(KVTransferParams.read(params))


def _peer_command(connector: Any, pool: Any, cmd: str, args: tuple, released: set, results: dict) -> Any:
    if cmd == "hold":  # the params as a prefill response carries them
        return connector.producer.hold(*args).to_json()
    if cmd == "blocks":
        return _block_bytes(pool, list(args[0]))
    if cmd == "wait_released":
        rid, timeout = args
        deadline = time.monotonic() + timeout
        while rid not in released and time.monotonic() < deadline:
            released.update(connector.producer.poll_released())
            time.sleep(0.01)
        return rid in released
    if cmd == "num_leases":
        return connector.num_leases()
    if cmd == "load":
        rid, params, local_ids, first_block, timeout = args
        connector.consumer.start_load(rid, _load_params(connector, params), local_ids, first_block)
        return _wait_load(connector, rid, timeout, results)
    if cmd == "start_load":
        rid, params, *rest = args
        connector.consumer.start_load(rid, _load_params(connector, params), *rest)
        return None
    if cmd == "wait_load":
        return _wait_load(connector, args[0], args[1], results)
    if cmd == "add_waiting":
        rid, params = args
        return connector.consumer.add_waiting(rid, _load_params(connector, params))
    if cmd == "remove_waiting":
        return connector.consumer.remove_waiting(*args)
    if cmd == "metrics":
        out = connector.metrics.snapshot()
        if connector.producer is not None:
            out["refused_handshakes"] = connector.producer.num_refused_handshakes
        if connector.consumer is not None:
            out["cached_remotes"] = connector.consumer.transfer.num_cached_remotes()
        return out
    if cmd == "lease_expiry":
        lease = connector.producer.leases.get(args[0])
        return None if lease is None else lease.expires_at - time.monotonic()
    raise ValueError(f"unknown command {cmd}")


def _wait_load(connector: Any, rid: str, timeout: float, results: dict) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while rid not in results and time.monotonic() < deadline:
        for r in connector.consumer.poll_loads():
            results[r.request_id] = r.__dict__
        time.sleep(0.002)
    return results.pop(rid, None)


# ---------------------------------------------------------------------------------------------------------
# the driver side


class Peer:
    def __init__(self, ctx: Any, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.info: dict[str, Any] | None = None

    def wait_ready(self) -> Peer:
        try:
            status, value = self._recv(60.0)
        except EOFError:
            raise RuntimeError(f"peer {self.spec['engine_id']} died during startup") from None
        if status != "ok":
            raise RuntimeError(f"peer failed to start:\n{value}")
        self.info = value
        return self

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    @property
    def port(self) -> int:
        assert self.info is not None
        return self.info["port"]

    def _recv(self, timeout: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.spec['engine_id']} did not answer within {timeout}s")
        return self.conn.recv()

    def call(self, cmd: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.conn.send((cmd, args))
        status, value = self._recv(timeout)
        if status != "ok":
            raise RuntimeError(f"peer command {cmd} failed: {value}")
        return value

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        """Stop by PID: politely if it answers, SIGKILL otherwise."""
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.call("stop", timeout=5.0)
                self.proc.join(timeout=5.0)
            except (OSError, RuntimeError, TimeoutError, EOFError, BrokenPipeError):
                pass
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
            self.proc.join(timeout=5.0)
        self.conn.close()


class LocalPeer:
    """The same command interface as Peer, with the connector in the test process (no spawn cost)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.connector, self.pool = _build_connector(spec)
        self.port = self.connector.side_channel_port
        self._released: set[str] = set()
        self._results: dict[str, Any] = {}

    def call(self, cmd: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        return _peer_command(self.connector, self.pool, cmd, args, self._released, self._results)

    def stop(self) -> None:
        self.connector.shutdown()


class Peers:
    """Starts peers in parallel and stops every one of them at the end."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.started: list[Peer] = []

    def start(self, *specs: dict[str, Any]) -> list[Peer]:
        peers = [Peer(self.ctx, s) for s in specs]
        self.started.extend(peers)
        return [p.wait_ready() for p in peers]

    def local(self, spec: dict[str, Any]) -> LocalPeer:
        peer = LocalPeer(spec)
        self.started.append(peer)  # type: ignore[arg-type]
        return peer

    def stop_all(self) -> None:
        for peer in self.started:
            peer.stop()


def producer_spec(**kw: Any) -> dict[str, Any]:
    return {"role": "kv_producer", "engine_id": f"prod-{uuid.uuid4().hex[:8]}", "seed": 1, **kw}


def consumer_spec(**kw: Any) -> dict[str, Any]:
    return {"role": "kv_consumer", "engine_id": f"cons-{uuid.uuid4().hex[:8]}", "seed": 2, **kw}


@pytest.fixture(scope="module", params=["loopback-no-secret", "deployment-secret"])
def kv_secret(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """Every test runs twice: without a secret (the loopback default) and with a deployment secret (what
    `pdserve up` gives its instances). Peers read it from the environment: spawned ones inherit it."""
    patch = pytest.MonkeyPatch()
    secret = f"e2e-{uuid.uuid4().hex}" if request.param == "deployment-secret" else None
    if secret is None:
        patch.delenv("PDSERVE_KV_SECRET", raising=False)
    else:
        patch.setenv("PDSERVE_KV_SECRET", secret)
    yield secret
    patch.undo()


@pytest.fixture(scope="module")
def peers(kv_secret: str | None) -> Iterator[Peers]:
    group = Peers()
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def pair(peers: Peers) -> tuple[Peer, Peer]:
    """A long-lived producer/consumer pair shared by the tests that do not kill anything."""
    producer, consumer = peers.start(producer_spec(), consumer_spec())
    return producer, consumer


def _roundtrip(
    producer: Peer | LocalPeer,
    consumer: Peer | LocalPeer,
    rid: str,
    remote_ids: list[int],
    local_ids: list[int],
    first_block: int = 0,
) -> dict[str, Any]:
    params = producer.call("hold", rid, remote_ids, len(remote_ids) * BLOCK_SIZE - 1, 0)
    result = consumer.call("load", f"d-{rid}", params, local_ids, first_block, 20.0)
    assert result is not None, "load did not finish"
    return result


# ---------------------------------------------------------------------------------------------------------
# tests


def test_hold_params_shape(pair: tuple[Peer, Peer]) -> None:
    producer, _ = pair
    params = producer.call("hold", "shape-1", [3, 4], 7, 4)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[3, 4]]
    assert params["remote_port"] == producer.port and params["remote_host"] == "127.0.0.1"
    assert params["remote_num_tokens"] == 7 and params["remote_prefill_cached_tokens"] == 4
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert params["transfer_mode"] == "pull" and params["remote_blocks_expiry_time"] is None
    assert isinstance(params["remote_registration_generation"], int)
    assert params["lease_expires_at"] > time.time()
    # Let it go again: the consumer never loads it, so abort it through the consumer path.
    _, consumer = pair
    consumer.call("add_waiting", "d-shape-1", params)
    consumer.call("remove_waiting", "d-shape-1")
    assert producer.call("wait_released", "shape-1", 10.0)


def test_scattered_and_adjacent_blocks_arrive_intact(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    # Scattered on both sides: no two consecutive pairs -> one descriptor per block.
    remote_ids, local_ids = [5, 9, 2, 30, 17], [40, 1, 22, 8, 13]
    result = _roundtrip(producer, consumer, "scatter", remote_ids, local_ids)
    assert result["ok"], result["error"]
    assert result["num_descriptors"] == 5
    assert result["bytes"] == 5 * 1024
    assert consumer.call("blocks", local_ids) == producer.call("blocks", remote_ids)
    assert producer.call("wait_released", "scatter", 10.0)

    # Adjacent runs coalesce where both sides are consecutive: [10,11,12]->[20,21,22], [13]->[30], [14,15]->[31,32]
    remote_ids, local_ids = [10, 11, 12, 13, 14, 15], [20, 21, 22, 30, 31, 32]
    result = _roundtrip(producer, consumer, "adjacent", remote_ids, local_ids)
    assert result["ok"], result["error"]
    assert result["num_descriptors"] == 2  # [10..12]->[20..22] and [13..15]->[30..32]
    assert consumer.call("blocks", local_ids) == producer.call("blocks", remote_ids)
    assert producer.call("wait_released", "adjacent", 10.0)
    assert producer.call("num_leases") == 0


def test_first_block_skips_the_locally_cached_prefix(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    before = consumer.call("blocks", [41, 42])
    result = _roundtrip(producer, consumer, "prefix", [3, 4, 5, 6], [41, 42, 43, 44], first_block=2)
    assert result["ok"], result["error"]
    assert result["bytes"] == 2 * 1024
    assert consumer.call("blocks", [41, 42]) == before  # the cached prefix is untouched
    assert consumer.call("blocks", [43, 44]) == producer.call("blocks", [5, 6])
    assert producer.call("wait_released", "prefix", 10.0)
    # Full local hit: nothing to read, the producer still frees at once.
    result = _roundtrip(producer, consumer, "fullhit", [7], [45], first_block=1)
    assert result["ok"] and result["bytes"] == 0
    assert producer.call("wait_released", "fullhit", 10.0)


def test_load_size_follows_the_tokens_the_engine_needs(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    # The decode side reserved an extra block for generated tokens: only the producer's blocks are read.
    params = producer.call("hold", "size-1", [11, 12], 8, 0)
    result = consumer.call("load", "d-size-1", params, [30, 31, 32], 0, 20.0)
    assert result["ok"] and result["bytes"] == 2 * 1024, result
    # With num_tokens the connector reads exactly the blocks covering them (7 tokens -> 2 blocks of 4).
    params = producer.call("hold", "size-2", [13, 14], 8, 0)
    consumer.call("start_load", "d-size-2", params, [33, 34, 35], 0, 7)
    result = consumer.call("wait_load", "d-size-2", 20.0)
    assert result["ok"] and result["bytes"] == 2 * 1024, result
    assert consumer.call("blocks", [33, 34]) == producer.call("blocks", [13, 14])
    # A producer that computed fewer tokens than the engine needs is a failure, not a silent short read.
    params = producer.call("hold", "size-3", [15], 4, 0)
    consumer.call("start_load", "d-size-3", params, [36, 37], 0, 7)
    result = consumer.call("wait_load", "d-size-3", 20.0)
    assert not result["ok"] and "7 tokens (2 blocks) are needed" in result["error"], result
    assert producer.call("wait_released", "size-3", 10.0)  # aborted early, not left to expire


def test_second_claim_of_the_same_lease_is_refused(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    params = producer.call("hold", "twice", [1, 2], 8, 0)
    first = consumer.call("load", "d-twice-1", params, [10, 11], 0, 20.0)
    assert first["ok"], first["error"]
    second = consumer.call("load", "d-twice-2", params, [12, 13], 0, 20.0)
    assert not second["ok"] and second["rejected"] == "unknown", second  # a client error, not a transfer fault


def test_leases_expire_unless_heartbeats_keep_them(peers: Peers) -> None:
    # The consumer heartbeats every lease/6 of ITS config, extending to now + 2/3 lease on the producer.
    # Lease logic does not depend on process boundaries, so both run in the test process.
    # 1.2 s lease: heartbeats every 0.2 s extend to now + 0.8 s, slack enough for a loaded 2-core CI box.
    extra = {"kv_lease_duration": 1.2}
    producer, consumer = peers.local(producer_spec(extra=extra)), peers.local(consumer_spec(extra=extra))

    # Never loaded, nobody waiting: freed by the reaper and counted; a late load is refused cleanly.
    params = producer.call("hold", "exp-1", [1, 2, 3], 11, 0)
    assert producer.call("wait_released", "exp-1", 10.0)
    assert producer.call("num_leases") == 0
    assert producer.call("metrics")["kv_expired_reqs"] == 1
    result = consumer.call("load", "d-exp-1", params, [5, 6, 7], 0, 20.0)
    assert not result["ok"] and "expired" in result["error"], result["error"]
    assert producer.call("metrics")["notifications_after_expiry"] == 1

    # Waiting on the consumer: heartbeats keep the lease for several original durations, then it loads.
    params = producer.call("hold", "hb-1", [6, 7], 8, 0)
    consumer.call("add_waiting", "d-hb-1", params)
    deadline = time.monotonic() + 2.6  # more than twice the original lease
    while time.monotonic() < deadline:
        assert producer.call("lease_expiry", "hb-1") is not None, "lease expired despite heartbeats"
        time.sleep(0.1)
    result = consumer.call("load", "d-hb-1", params, [20, 21], 0, 20.0)
    assert result["ok"], result["error"]
    assert consumer.call("blocks", [20, 21]) == producer.call("blocks", [6, 7])
    assert producer.call("wait_released", "hb-1", 10.0)
    assert producer.call("metrics")["kv_expired_reqs"] == 1
    producer.stop()
    consumer.stop()


def test_compatibility_mismatch_fails_on_both_sides(peers: Peers, pair: tuple[Peer, Peer]) -> None:
    _, consumer = pair
    other_bs = (48, 2, 2, 8, 2, 8)  # same bytes per block, different block_size/head_dim
    p_bs = peers.local(producer_spec(shape=other_bs))
    p_dtype = peers.local(producer_spec(dtype="float32", shape=(48, 2, 2, 4, 2, 8)))  # same bytes/block
    for producer, field in ((p_bs, "block_size"), (p_dtype, "dtype")):
        params = producer.call("hold", "cmp", [1], 4, 0)
        result = consumer.call("load", f"d-cmp-{field}", params, [2], 0, 20.0)
        assert not result["ok"]
        assert field in result["error"] and "incompatible" in result["error"], result["error"]
        assert producer.call("metrics")["refused_handshakes"] == 1
        # The consumer told the (reachable) producer to free the lease instead of letting it expire.
        assert producer.call("wait_released", "cmp", 10.0)
        assert producer.call("metrics")["kv_expired_reqs"] == 0
        producer.stop()


def test_killed_producer_fails_the_load_in_bounded_time(peers: Peers, pair: tuple[Peer, Peer]) -> None:
    producer_ok, consumer = pair
    (victim,) = peers.start(producer_spec())
    warm = _roundtrip(victim, consumer, "kill-warm", [1], [3])  # handshake cached, connection up
    assert warm["ok"], warm["error"]
    params = victim.call("hold", "kill-1", [2, 3], 8, 0)
    victim.signal(signal.SIGKILL)
    victim.proc.join(timeout=10.0)
    t0 = time.monotonic()
    result = consumer.call("load", "d-kill-1", params, [4, 5], 0, 20.0)
    assert not result["ok"] and result["error"]
    assert time.monotonic() - t0 < 10.0  # bounded (the timeouts are 2 s); not a performance assertion
    # The consumer still works with another producer.
    result = _roundtrip(producer_ok, consumer, "after-kill", [8, 9], [8, 9])
    assert result["ok"], result["error"]


def test_frozen_producer_fails_the_load_in_bounded_time(peers: Peers, pair: tuple[Peer, Peer]) -> None:
    producer_ok, consumer = pair
    known, fresh = peers.start(producer_spec(), producer_spec())
    warm = _roundtrip(known, consumer, "stop-warm", [1], [3])  # handshake cached: the claim will hang
    assert warm["ok"], warm["error"]
    params = {v.spec["engine_id"]: v.call("hold", "stop-1", [2, 3], 8, 0) for v in (known, fresh)}
    for victim in (known, fresh):
        victim.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        consumer.call("start_load", "d-stop-known", params[known.spec["engine_id"]], [4, 5], 0)
        consumer.call("start_load", "d-stop-fresh", params[fresh.spec["engine_id"]], [6, 7], 0)
        results = [consumer.call("wait_load", rid, 20.0) for rid in ("d-stop-known", "d-stop-fresh")]
        elapsed = time.monotonic() - t0
    finally:
        for victim in (known, fresh):
            victim.signal(signal.SIGCONT)
    # The known producer (handshake cached) fails at its first exchange after the stop: normally the claim's
    # side-channel timeout. Once (a CI clone on a loaded 2-core box, 2026-12-02) the claim was granted and the
    # NIXL READ timed out instead; why the stopped process answered the claim was not established. Either
    # way the frozen producer is found by a 2 s timeout and the load fails in bounded time, which is the point.
    assert "no reply to claim" in results[0]["error"] or "not complete after" in results[0]["error"], results[0]
    assert "no reply to handshake" in results[1]["error"], results[1]
    assert elapsed < 10.0  # bounded by the 2 s side-channel timeouts, never a hang
    known.stop()
    fresh.stop()
    result = _roundtrip(producer_ok, consumer, "after-stop", [10], [10])
    assert result["ok"], result["error"]


def test_restarted_producer_is_handshaken_again(peers: Peers, pair: tuple[Peer, Peer]) -> None:
    _, consumer = pair
    spec = producer_spec(seed=11)
    first = peers.local(spec)
    result = _roundtrip(first, consumer, "restart-1", [1, 2], [1, 2])
    assert result["ok"], result["error"]
    stale_params = first.call("hold", "restart-stale", [3], 4, 0)
    first.stop()
    # Same engine id (so the same NIXL agent name) and port, new memory and metadata.
    second = peers.local({**spec, "port": first.port, "seed": 12})
    result = _roundtrip(second, consumer, "restart-2", [5, 6], [5, 6])
    assert result["ok"], result["error"]
    assert consumer.call("blocks", [5, 6]) == second.call("blocks", [5, 6])
    # Params issued by the dead incarnation can never read the new one's memory.
    result = consumer.call("load", "d-restart-stale", stale_params, [7], 0, 20.0)
    assert not result["ok"] and "restarted" in result["error"], result["error"]
    second.stop()


def test_tcp_transport_where_the_target_must_progress(peers: Peers) -> None:
    # Over TCP the READ is software-emulated: the producer's progress loop serves it.
    env = {"UCX_TLS": "self,tcp"}
    shape = (64, 4, 2, 16, 8, 64)  # 128 KiB blocks, 8 MiB pool
    producer, consumer = peers.start(producer_spec(env=env, shape=shape), consumer_spec(env=env, shape=shape))
    remote_ids = list(range(0, 40, 2))
    local_ids = list(range(20, 40))
    result = _roundtrip(producer, consumer, "tcp-1", remote_ids, local_ids)
    assert result["ok"], result["error"]
    assert consumer.call("blocks", local_ids) == producer.call("blocks", remote_ids)
    assert producer.call("wait_released", "tcp-1", 10.0)

    # Freeze the producer a moment after the load starts (usually mid-READ, which takes tens of ms here).
    # Wherever the stop lands, the load must end in bounded time, and if it claims success the bytes are right.
    all_ids = list(range(64))
    params = producer.call("hold", "tcp-2", all_ids, 64 * 16, 0)
    consumer.call("start_load", "d-tcp-2", params, all_ids, 0)
    time.sleep(0.01)
    producer.signal(signal.SIGSTOP)
    try:
        result = consumer.call("wait_load", "d-tcp-2", 20.0)
    finally:
        producer.signal(signal.SIGCONT)
    assert result is not None
    if result["ok"]:
        assert consumer.call("blocks", all_ids) == producer.call("blocks", all_ids)
    producer.stop()
    consumer.stop()


def test_kv_both_instances_serve_each_other(peers: Peers) -> None:
    """kv_both: one NIXL agent serves as READ target and initiator at once; role errors are clear."""
    a, b = (
        peers.local(producer_spec(role="kv_both", seed=5)),
        peers.local(consumer_spec(role="kv_both", seed=6)),
    )
    for src, dst, rid in ((a, b, "ab"), (b, a, "ba")):
        result = _roundtrip(src, dst, rid, [1, 2, 9], [3, 4, 5])
        assert result["ok"], result["error"]
        assert dst.call("blocks", [3, 4, 5]) == src.call("blocks", [1, 2, 9])
        assert src.call("wait_released", rid, 10.0)
    consumer_only = peers.local(consumer_spec())
    assert consumer_only.connector.producer is None and not consumer_only.connector.can_send  # serves no KV
    assert consumer_only.port is None


def test_torch_bf16_pools_in_one_process() -> None:
    """Torch tensors (data_ptr path), two connectors (and metric registries) in one process."""
    torch = pytest.importorskip("torch")
    from prometheus_client import generate_latest

    from pdserve.kv_transfer import KVConnector, KVTransferConfig, make_compat

    shape = (16, 2, 2, 4, 2, 16)
    compat = make_compat(
        model="m", dtype=torch.bfloat16, block_size=4, num_layers=2, num_kv_heads=2, head_dim=16
    )
    src = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    dst = torch.zeros(shape, dtype=torch.bfloat16)

    def config(role: str) -> KVTransferConfig:
        return KVTransferConfig.from_json(
            {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": f"{role}-{uuid.uuid4().hex[:6]}"},
            side_channel_host="127.0.0.1",
            side_channel_port=0,
        )

    with (
        KVConnector(config("kv_producer"), src, compat, 4) as prod,
        KVConnector(config("kv_consumer"), dst, compat, 4) as cons,
    ):
        params = prod.producer.hold("t1", [7, 8, 3], 12, 0).to_json()
        cons.consumer.start_load("d-t1", _load_params(cons, params), [1, 2, 3], 0)
        results: list[Any] = []
        deadline = time.monotonic() + 20.0
        while not results and time.monotonic() < deadline:
            results = cons.consumer.poll_loads()
            time.sleep(0.002)
        assert results and results[0].ok, results
        assert results[0].num_descriptors == 2 and results[0].bytes == 3 * src[0].numel() * 2
        assert torch.equal(dst[[1, 2, 3]], src[[7, 8, 3]])
        assert not dst[0].any() and not dst[4:].any()
        released: list[str] = []
        while not released and time.monotonic() < deadline:
            released = prod.producer.poll_released()
            time.sleep(0.002)
        assert released == ["t1"] and prod.num_leases() == 0
        text = generate_latest(cons.metrics.registry).decode()
        assert 'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 1.0' in text
        assert 'vllm:nixl_num_descriptors_sum{engine="0",model_name="m"} 2.0' in text


def test_port_in_use_names_the_port(pair: tuple[Peer, Peer], peers: Peers) -> None:
    from pdserve.kv_transfer.errors import SideChannelError

    producer, _ = pair
    with pytest.raises(SideChannelError, match=rf"port {producer.port}\b.*already in use"):
        peers.local(producer_spec(port=producer.port))
    # Also when something other than pdserve holds it.
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    try:
        port = blocker.getsockname()[1]
        with pytest.raises(SideChannelError, match=rf"port {port}\b.*already in use"):
            peers.local(producer_spec(port=port))
    finally:
        blocker.close()
