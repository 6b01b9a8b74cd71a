"""The KV side channel under attack, on loopback: a real producer (side channel, leases, NIXL agent and DRAM
pool), a real victim consumer with the deployment secret, and an attacker process-in-the-middle or beside.

What is shown (ARCHITECTURE.md, "KV side channel security"):
- without the secret nobody completes a handshake, obtains agent metadata, or claims, heartbeats, aborts or
  releases any lease (even one whose token it stole), and the refusal says nothing about what is expected;
- with the secret but without a lease's token nobody touches that lease (claim, abort, release refused; a
  heartbeat does not extend it);
- captured messages replayed verbatim, or tampered with, are refused;
- a decode instance made to dial an attacker's address (forged params) hands over a signed handshake, but the
  producer's answer to it carries the agent metadata sealed with the secret: useless when relayed;
- every refusal is counted (`pdserve:kv_side_channel_refused_total{reason}`) and logged;
- what NIXL itself allows: whoever holds the agent metadata can READ registered memory without any claim.
  That is why the metadata goes to authenticated peers only (the last test pins this down).
Every wait is bounded; every connector and socket is closed at the end.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest

from pdserve.kv_transfer.errors import NixlUnavailableError
from pdserve.kv_transfer.nixl_agent import load_nixl

try:
    load_nixl()
except NixlUnavailableError as exc:
    pytest.skip(f"NIXL not importable: {exc}", allow_module_level=True)

from prometheus_client import generate_latest

from pdserve.api import pd
from pdserve.kv_transfer import KVConnector, KVTransferConfig, make_compat
from pdserve.kv_transfer.auth import REQUEST, MessageAuth, new_nonce
from pdserve.kv_transfer.compat import PROTOCOL_VERSION
from pdserve.kv_transfer.errors import TransferFailed
from pdserve.kv_transfer.nixl_agent import NixlAgent
from pdserve.kv_transfer.pool import RemotePool, coalesce_block_runs, descriptor_arrays, region_of
from pdserve.kv_transfer.side_channel import FrameDecoder, encode_frame

SHAPE = (32, 2, 2, 4, 2, 16)  # 32 blocks of 1 KiB (float16)
SECRET = "security-test-" + uuid.uuid4().hex
WAIT_S = 20.0


def _pool(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE, dtype=np.float32).astype("float16")


def _connector(role: str, pool: np.ndarray) -> KVConnector:
    config = KVTransferConfig.from_json(
        {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": f"{role}-{uuid.uuid4().hex[:8]}"},
        side_channel_host="127.0.0.1", side_channel_port=0, env={"PDSERVE_KV_SECRET": SECRET},
    )
    compat = make_compat(model="tiny-secure", dtype=str(pool.dtype), block_size=SHAPE[3], num_layers=SHAPE[1],
                         num_kv_heads=SHAPE[4], head_dim=SHAPE[5])
    return KVConnector(config, pool, compat, SHAPE[3])


@pytest.fixture(scope="module")
def producer() -> Iterator[tuple[KVConnector, np.ndarray]]:
    pool = _pool(1)
    conn = _connector("kv_producer", pool)
    yield conn, pool
    conn.shutdown()


@pytest.fixture(scope="module")
def victim() -> Iterator[tuple[KVConnector, np.ndarray]]:
    pool = np.zeros(SHAPE, dtype="float16")
    conn = _connector("kv_consumer", pool)
    yield conn, pool
    conn.shutdown()


def _hold(producer: KVConnector, *args: Any) -> dict[str, Any]:
    """The params a prefill response carries, as they travel (the wire form a decode leg sends back)."""
    return producer.producer.hold(*args).to_json()


def _load(consumer: KVConnector, rid: str, params: dict[str, Any], local: list[int]) -> Any:
    role = consumer.consumer
    role.start_load(rid, role.parse(pd.KVTransferParams.read(params)), local, 0)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for result in role.poll_loads():
            if result.request_id == rid:
                return result
        time.sleep(0.005)
    raise AssertionError(f"load {rid} did not finish within {WAIT_S}s")


def _refused(conn: KVConnector) -> dict[str, float]:
    """The producer's `pdserve:kv_side_channel_refused_total` by reason, from its Prometheus registry."""
    out: dict[str, float] = {}
    for line in generate_latest(conn.metrics.registry).decode().splitlines():
        if line.startswith("pdserve:kv_side_channel_refused_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _exchange(port: int, frame: bytes) -> tuple[dict[str, Any], bytes]:
    """Send one frame the way an attacker would (no checks of its own); the reply's message and raw bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(frame)
        decoder, raw = FrameDecoder(), b""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            raw += data
            frames = decoder.feed(data)
            if frames:
                return msgpack.unpackb(msgpack.unpackb(frames[0])["msg"]), raw
    raise AssertionError("no reply")


def _envelope_of(frame: bytes) -> dict[str, Any]:
    """A captured frame's envelope (its length prefix cut off), as a plain map."""
    return msgpack.unpackb(FrameDecoder().feed(frame)[0])


def _forge(op: str, to: str, *, auth: MessageAuth | None = None, **fields: Any) -> bytes:
    payload = msgpack.packb({"op": op, "to": to, "ts": time.time(), "nonce": new_nonce(), **fields})
    mac = auth.sign(REQUEST, payload) if auth is not None else None
    return encode_frame(msgpack.packb({"v": PROTOCOL_VERSION, "msg": payload, "mac": mac}))


def _lease_ops(rid: str, token: str, generation: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("claim", {"request_id": rid, "lease_token": token, "generation": generation, "timeout_s": 5.0}),
        ("heartbeat", {"request_ids": [rid], "lease_tokens": [token]}),
        ("abort", {"request_id": rid, "lease_token": token}),
        ("release", {"request_id": rid, "lease_token": token, "claim_token": "guess"}),
    ]


def test_without_the_secret_nothing_is_answered(producer, victim, caplog) -> None:
    prod, prod_pool = producer
    cons, cons_pool = victim
    engine, port = prod.engine_id, prod.side_channel_port
    params = _hold(prod, "victim-1", [3, 4, 5], 11, 0)
    lease = prod.producer.leases.get("victim-1")
    expires_at = lease.expires_at
    metadata = prod._agent.metadata()  # what an attacker would need for NIXL READs
    before = _refused(prod).get("unauthenticated", 0.0)
    compat = make_compat(model="tiny-secure", dtype="float16", block_size=4, num_layers=2, num_kv_heads=2,
                         head_dim=16)
    wrong = MessageAuth("not-the-secret-" + uuid.uuid4().hex)
    attempts = [("handshake", {"engine_id": "attacker", "compat": {**compat, "model": "guess"}})]
    # even the lease's own token (stolen from a response) is useless without the secret
    attempts += _lease_ops("victim-1", params["remote_lease_token"], prod.producer.generation)
    with caplog.at_level("WARNING", logger="pdserve.kv_transfer"):
        for auth in (None, wrong):
            for op, fields in attempts:
                reply, raw = _exchange(port, _forge(op, engine, auth=auth, **fields))
                assert reply["ok"] is False and reply["reason"] == "unauthenticated", (op, reply)
                assert set(reply) == {"re", "ok", "reason", "error"}
                assert metadata not in raw and b"agent" not in raw
                # the refusal names nothing the producer would accept (no compat value, no expected field)
                for leaked in ("tiny-secure", "float16", "block_size", engine, SECRET):
                    assert leaked not in reply["error"], (op, reply["error"])
    assert _refused(prod)["unauthenticated"] == before + 2 * len(attempts)
    assert "KV side channel refused" in caplog.text and "(unauthenticated)" in caplog.text
    # the victim's lease is untouched: not claimed, not freed, not extended
    lease = prod.producer.leases.get("victim-1")
    assert lease is not None and lease.state.value == "held" and lease.expires_at == expires_at
    result = _load(cons, "d-victim-1", params, [10, 11, 12])
    assert result.ok, result.error
    assert np.array_equal(cons_pool[[10, 11, 12]], prod_pool[[3, 4, 5]])


def test_with_the_secret_but_not_the_lease_token_no_lease_can_be_touched(producer, victim) -> None:
    prod, prod_pool = producer
    cons, cons_pool = victim
    engine, port, auth = prod.engine_id, prod.side_channel_port, MessageAuth(SECRET)
    params = _hold(prod, "victim-2", [6, 7], 7, 0)
    expires_at = prod.producer.leases.get("victim-2").expires_at
    before = _refused(prod).get("bad_token", 0.0)
    forged_token = "x" * len(params["remote_lease_token"])
    for op, fields in _lease_ops("victim-2", forged_token, prod.producer.generation):
        reply, _ = _exchange(port, _forge(op, engine, auth=auth, **fields))
        if op == "heartbeat":  # answered, but the lease is reported unknown and not extended
            assert reply["ok"] is True and reply["unknown"] == ["victim-2"], reply
        else:
            assert reply["ok"] is False and reply["reason"] == "bad_token", (op, reply)
            assert params["remote_lease_token"] not in reply["error"]
    assert _refused(prod)["bad_token"] == before + 4
    lease = prod.producer.leases.get("victim-2")
    assert lease is not None and lease.state.value == "held" and lease.expires_at == expires_at
    # forged params through the real consumer path: refused as a lease rejection, not a failed transfer
    failed_before = cons.metrics.snapshot()["failed_transfers"]
    forged = _load(cons, "d-forged-2", {**params, "remote_lease_token": forged_token}, [13, 14])
    assert not forged.ok and forged.rejected == "bad_token", forged
    snap = cons.metrics.snapshot()
    assert snap["failed_transfers"] == failed_before and snap["lease_rejected"] >= 1
    text = generate_latest(cons.metrics.registry).decode()
    assert 'pdserve:kv_lease_rejected_total{engine="0",model_name="tiny-secure",reason="bad_token"}' in text
    result = _load(cons, "d-victim-2", params, [13, 14])
    assert result.ok, result.error
    assert np.array_equal(cons_pool[[13, 14]], prod_pool[[6, 7]])
    # replaying the victim's own params after its read: the lease is gone (a client error, not a transfer fault)
    again = _load(cons, "d-victim-2-again", params, [15, 16])
    assert not again.ok and again.rejected == "unknown", again


class _Relay:
    """A TCP relay on loopback that records what the consumer sends: an attacker on the path."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.captured: list[bytes] = []  # each connection's client->producer bytes
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._pipe, args=(client,), daemon=True)
            t.start()
            self._threads.append(t)

    def _pipe(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.target_port), timeout=5.0) as upstream:
            client.settimeout(5.0)
            request, decoder = b"", FrameDecoder()
            while True:  # one request frame per connection
                chunk = client.recv(65536)
                if not chunk:
                    return
                request += chunk
                if decoder.feed(chunk):
                    break
            self.captured.append(request)
            upstream.sendall(request)
            decoder = FrameDecoder()
            while chunk := upstream.recv(65536):
                client.sendall(chunk)
                if decoder.feed(chunk):
                    break

    def close(self) -> None:
        self._stop.set()
        self._accept.join(timeout=5.0)
        for t in self._threads:
            t.join(timeout=5.0)
        self.sock.close()


def test_captured_messages_cannot_be_replayed_or_altered(producer) -> None:
    prod, prod_pool = producer
    port = prod.side_channel_port
    # a fresh consumer, so that its handshake goes through the relay too
    pool = np.zeros(SHAPE, dtype="float16")
    cons = _connector("kv_consumer", pool)
    relay = _Relay(port)
    try:
        params = _hold(prod, "victim-3", [8, 9], 7, 0)
        result = _load(cons, "d-victim-3", {**params, "remote_port": relay.port}, [1, 2])
        assert result.ok, result.error
        assert np.array_equal(pool[[1, 2]], prod_pool[[8, 9]])
        ops = [msgpack.unpackb(_envelope_of(frame)["msg"])["op"] for frame in relay.captured]
        assert ops == ["handshake", "claim", "release"], ops
        before = _refused(prod).get("replay", 0.0)
        metadata = prod._agent.metadata()
        for frame in relay.captured:
            reply, raw = _exchange(port, frame)
            assert reply["ok"] is False and reply["reason"] == "replay", reply
            assert metadata not in raw
        assert _refused(prod)["replay"] == before + 3
        # the captured claim, pointed at another lease with its own token: the signature no longer matches
        other = _hold(prod, "victim-3b", [10], 3, 0)
        envelope = _envelope_of(relay.captured[1])
        claim = msgpack.unpackb(envelope["msg"])
        altered = msgpack.packb({**claim, "request_id": "victim-3b", "lease_token": other["remote_lease_token"],
                                 "nonce": new_nonce(), "ts": time.time()})
        reply, _ = _exchange(port, encode_frame(msgpack.packb({**envelope, "msg": altered})))
        assert reply["ok"] is False and reply["reason"] == "unauthenticated", reply
        assert prod.producer.leases.get("victim-3b").state.value == "held"
        assert prod.producer.leases.get("victim-3b") is not None
    finally:
        relay.close()
        cons.shutdown()


def test_a_decode_instance_is_no_signing_oracle_for_the_metadata(producer, victim) -> None:
    """Forged params can make a decode instance dial any address and send it a signed handshake for any
    producer; relayed within the skew window, that request is valid. The reply's agent metadata is
    concealed with the secret, so the relay gains nothing it can use."""
    prod, _ = producer
    cons, _ = victim
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(WAIT_S)
    relayed: dict[str, Any] = {}

    def relay() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5.0)
            request, decoder = b"", FrameDecoder()
            while not decoder.feed(chunk := conn.recv(65536)) and chunk:
                request += chunk
            relayed["reply"], relayed["raw"] = _exchange(prod.side_channel_port, request + chunk)
            # and the decode gets no answer: its load fails as a transport failure

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        forged = _hold(prod, "oracle", [22], 3, 0)
        forged["remote_port"] = listener.getsockname()[1]  # the attacker's listener, the producer's identity
        result = _load(cons, "d-oracle", forged, [23])
        assert not result.ok and result.rejected is None
    finally:
        thread.join(timeout=WAIT_S)
        listener.close()
    reply = relayed["reply"]
    assert reply["ok"] is True  # the relayed request was genuine and fresh...
    metadata = prod._agent.metadata()
    assert metadata not in relayed["raw"] and reply["agent_metadata"] != metadata  # ...its answer is sealed
    agent = NixlAgent(f"relay-{uuid.uuid4().hex[:6]}", ("UCX",), {})
    try:
        agent.register(region_of(np.zeros(SHAPE, dtype="float16")))
        with pytest.raises(TransferFailed):
            agent.add_remote(reply["agent_metadata"], reply["agent_name"])
    finally:
        agent.close()


def test_whoever_holds_the_agent_metadata_can_read_registered_memory(producer) -> None:
    """NIXL/UCX has no access control of its own: a peer with the agent metadata can READ any registered
    block, claim or no claim. This pins down the limit the docs state (metadata goes to authenticated peers
    only; keep the UCX ports on an isolated network), so a change in it is noticed."""
    prod, prod_pool = producer
    auth = MessageAuth(SECRET)  # an insider: holds the deployment secret, never claims anything
    compat = make_compat(model="tiny-secure", dtype="float16", block_size=4, num_layers=2, num_kv_heads=2,
                         head_dim=16)
    reply, _ = _exchange(prod.side_channel_port,
                         _forge("handshake", prod.engine_id, auth=auth, engine_id="insider", compat=compat))
    assert reply["ok"] is True and reply["agent_metadata"]
    metadata = auth.reveal(reply["agent_metadata"], reply["re"], reply["generation"])
    assert metadata == prod._agent.metadata()
    local = np.zeros(SHAPE, dtype="float16")
    agent = NixlAgent(f"insider-{uuid.uuid4().hex[:6]}", ("UCX",), {})
    try:
        region = region_of(local)
        agent.register(region)
        name = agent.add_remote(metadata, reply["agent_name"])
        remote = msgspec.convert(reply["pool"], RemotePool)
        held = _hold(prod, "victim-4", [20, 21], 7, 0)
        assert held["remote_lease_token"]
        local_descs, remote_descs = descriptor_arrays(coalesce_block_runs([0, 1], [20, 21]), region, remote)
        agent.read(local_descs=local_descs, local_mem=region.mem_type, remote_descs=remote_descs,
                   remote_mem=remote.mem_type, remote_name=name, notif=b"insider",
                   deadline=time.monotonic() + WAIT_S)
        assert np.array_equal(local[[0, 1]], prod_pool[[20, 21]])
        assert prod.producer.leases.get("victim-4").state.value == "held"  # never claimed
    finally:
        agent.close()
