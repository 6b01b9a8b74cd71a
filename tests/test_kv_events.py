"""KV events: the block hash (vLLM's sha256_cbor, checked against cbor2), the block manager's events, their
msgpack wire form decoded with vLLM's own msgspec struct layout, and a real server publishing them to a real
ZMQ SUB socket, with sequence numbers and replay."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import cbor2
import httpx
import msgspec
import pytest
import zmq
from server_utils import MODEL, ServerProcess, make_model_dir

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.kv_events.block_hash import (
    NONE_HASH,
    block_hashes,
    external_block_hashes,
    hash_block_tokens,
)
from pdserve.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from pdserve.types.kv_events_config import KVEventsConfig
from pdserve.types.sampling_params import SamplingParams


# ---- vLLM's declarations (vllm/distributed/kv_events.py after vllm#42892), to decode our payloads the way
# vLLM's subscribers do: a positional batch of tagged map events ------------------------------------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)


# vLLM before #42892: the events positional too (what older subscribers decode, and what we still read)
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(VEventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


def test_block_hash_is_vllm_sha256_cbor():
    assert hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest() == NONE_HASH
    parent = None
    tokens = [0, 1, 23, 24, 255, 256, 65535, 65536, 151_000, 7, 9, 11, 13, 15, 17, 19] * 3
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 3 and block_hashes(tokens + [5] * 15, 16) == hashes  # partial block: no hash
    for i, h in enumerate(hashes):
        ref = hashlib.sha256(cbor2.dumps((parent or NONE_HASH, tuple(tokens[16 * i:16 * i + 16]), None),
                                         canonical=True)).digest()
        assert h == ref == hash_block_tokens(parent, tokens[16 * i:16 * i + 16])
        parent = h
    assert external_block_hashes(tokens, 16) == [int.from_bytes(h[-8:], "big") for h in hashes]
    with pytest.raises(ValueError):
        hash_block_tokens(None, [-1])
    # ids of 4 and 8 bytes (the encoder inlines ids below 2^32)
    wide = [2**32 - 1, 2**32, 2**40, 65537]
    assert block_hashes(wide, 4) == [hashlib.sha256(cbor2.dumps((NONE_HASH, tuple(wide), None),
                                                               canonical=True)).digest()]


def test_token_slice_is_token_at_over_a_range():
    req = _req("r", [10, 11, 12, 13, 14])
    req.output_token_ids += [20, 21, 22]
    for start in range(req.num_tokens):
        for end in range(start, req.num_tokens + 1):
            assert req.token_slice(start, end) == [req.token_at(i) for i in range(start, end)]


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), frozenset(), 4096)


def _fill(bm: BlockManager, req: Request) -> None:
    assert bm.allocate(req, req.num_tokens, bm.find_cached_prefix(req))
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_block_manager_events():
    bm = BlockManager(num_blocks=6, block_size=4, enable_events=True)
    a = _req("a", list(range(10, 20)))  # 2 full blocks + 2 tokens
    _fill(bm, a)
    (ev,) = bm.take_events()
    assert isinstance(ev, BlockStored) and ev.medium == "GPU" and ev.block_size == 4
    assert ev.block_hashes == external_block_hashes(a.prompt_token_ids, 4) and ev.parent_block_hash is None
    assert ev.token_ids == list(range(10, 18))
    assert bm.take_events() == []
    # a request sharing the first block: only its second, new block is stored, with the shared parent
    b = _req("b", list(range(10, 14)) + [99, 98, 97, 96, 1])
    _fill(bm, b)
    (ev,) = bm.take_events()
    assert ev.block_hashes == external_block_hashes(b.prompt_token_ids, 4)[1:]
    assert ev.parent_block_hash == external_block_hashes(b.prompt_token_ids, 4)[0]
    assert ev.token_ids == [99, 98, 97, 96]
    bm.release(a)
    bm.release(b)
    # pool pressure evicts LRU cached blocks: one merged BlockRemoved, then the new blocks' BlockStored
    c = _req("c", list(range(200, 216)) + [1])
    _fill(bm, c)
    removed, stored = bm.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    # LRU: the tails go first (a's and b's second blocks); the shared first block is kept
    assert removed.block_hashes == [external_block_hashes(a.prompt_token_ids, 4)[1],
                                    external_block_hashes(b.prompt_token_ids, 4)[1]]
    assert stored.block_hashes == external_block_hashes(c.prompt_token_ids, 4)
    bm.reset_prefix_cache()
    assert [type(e) for e in bm.take_events()] == [AllBlocksCleared]


def test_no_events_unless_enabled():
    bm = BlockManager(num_blocks=4, block_size=4)
    _fill(bm, _req("a", list(range(9))))
    assert bm.take_events() == []


def test_wire_form_decodes_with_vllm_structs():
    batch = KVEventBatch(ts=1234.5, events=[
        BlockStored([2**64 - 1, 5], None, list(range(8)), 4, medium="GPU"),
        BlockStored([7], 5, [1, 2, 3, 4], 4, medium="CPU"),
        BlockRemoved([2**64 - 1, 5], medium="GPU"),
        AllBlocksCleared(),
    ])
    payload = encode_batch(batch)
    v = VLLM_DECODER.decode(payload)
    assert v.ts == 1234.5 and v.data_parallel_rank == 0
    s0, s1, r, c = v.events
    assert isinstance(s0, VBlockStored) and s0.block_hashes == [2**64 - 1, 5] and s0.parent_block_hash is None
    assert s0.token_ids == list(range(8)) and s0.block_size == 4 and s0.medium == "GPU" and s0.lora_id is None
    assert s0.extra_keys == [None, None] and s0.group_idx == 0 and s0.kv_cache_spec_kind == "full_attention"
    assert s1.parent_block_hash == 5 and s1.medium == "CPU"
    assert isinstance(r, VBlockRemoved) and r.block_hashes == [2**64 - 1, 5] and r.medium == "GPU"
    assert isinstance(c, VAllBlocksCleared)
    # and vLLM's own encoding decodes with ours (what the proxy relies on for vLLM instances)
    vllm_payload = msgspec.msgpack.encode(VKVEventBatch(ts=1.0, events=[
        VBlockStored([3], None, [1, 2], 2, None, "GPU", None), VBlockRemoved([3], "GPU"), VAllBlocksCleared()],
        data_parallel_rank=0))
    legacy_payload = msgspec.msgpack.encode(LegacyBatch(ts=1.0, events=[
        LegacyBlockStored([3], None, [1, 2], 2, None, "GPU", None), LegacyBlockRemoved([3], "GPU"),
        LegacyAllBlocksCleared()], data_parallel_rank=0))
    map_envelope = msgspec.msgpack.encode({"ts": 1.0, "events": msgspec.msgpack.decode(vllm_payload)[1]})
    for theirs in (vllm_payload, legacy_payload, map_envelope):
        ours = decode_batch(theirs)
        assert [type(e) for e in ours.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
        assert ours.events[0].block_hashes == [3] and ours.events[0].token_ids == [1, 2]
        assert ours.events[1].medium == "GPU"
    assert decode_batch(payload) == KVEventBatch(ts=1234.5, events=[
        BlockStored([2**64 - 1, 5], None, list(range(8)), 4, medium="GPU"),
        BlockStored([7], 5, [1, 2, 3, 4], 4, medium="CPU"),
        BlockRemoved([2**64 - 1, 5], medium="GPU"), AllBlocksCleared()], data_parallel_rank=0)


def test_config_validation():
    assert KVEventsConfig.from_json(None) is None
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert cfg.active and cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:5557"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').active
    for bad in ('{"enable_kv_cache_events": true, "bogus": 1}', '[1]', '{"publisher": "kafka"}', "{",
                '{"endpoint": "http://x:1"}', '{"buffer_steps": 0}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)


# ---- a real server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("kv-events-model"))


def _recv_batches(sub: zmq.Socket, want, timeout_s: float = 60.0) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) frames until want(frames) holds (bounded)."""
    frames: list[tuple[bytes, int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not want(frames):
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            frames.append((topic, int.from_bytes(seq, "big"), payload))
    return frames


def _complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_publishes_vllm_events_with_replay(served_model, tmp_path):
    cfg = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", '
           '"replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@tiny"}')
    srv = ServerProcess(served_model, tmp_path / "srv.log", "--kv-events-config", cfg, "--block-size", "16",
                        "--num-gpu-blocks-override", "12", "--max-model-len", "512")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        srv.wait_ready()
        info = httpx.get(f"{srv.url}/pdserve/info", timeout=10).json()["kv_events"]
        assert info["topic"] == "kv@tiny" and info["block_size"] == 16
        assert info["endpoint"].startswith("tcp://127.0.0.1:") and info["replay_endpoint"].startswith("tcp://127.0.0.1:")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@tiny")
        sub.connect(info["endpoint"])
        time.sleep(0.5)  # PUB/SUB: a subscription reaches the publisher asynchronously
        prompts = [[(7 * i + j) % 300 + 3 for j in range(50)] for i in range(5)]  # 3 full blocks each
        for p in prompts:
            _complete(srv.url, p)
        frames = _recv_batches(sub, lambda fr: sum(
            isinstance(e, VBlockRemoved) for _, _, pl in fr for e in VLLM_DECODER.decode(pl).events) > 0
            and len(fr) >= 5)
        assert frames, srv.log()
        seqs = [s for _, s, _ in frames]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert all(t == b"kv@tiny" for t, _, _ in frames)
        events = [e for _, _, pl in frames for e in VLLM_DECODER.decode(pl).events]
        stored = {h for e in events if isinstance(e, VBlockStored) for h in e.block_hashes}
        # every prompt's first 3 blocks (prompt 50 tokens + 1 output: 3 full blocks) were announced
        for p in prompts:
            assert set(external_block_hashes(p, 16)) <= stored
        # the 12-block pool cannot hold 5 x 4 blocks: evictions were announced, of announced blocks only
        removed = [h for e in events if isinstance(e, VBlockRemoved) for h in e.block_hashes]
        assert removed and set(removed) <= stored
        assert all(e.medium == "GPU" for e in events if not isinstance(e, VAllBlocksCleared))
        # replay: everything from the first seen seq comes back identical, then the end marker
        dealer.connect(info["replay_endpoint"])
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed[: len(frames)] == [(s, pl) for _, s, pl in frames]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        srv.stop()


def test_server_refuses_bad_events_config(served_model, tmp_path):
    srv = ServerProcess(served_model, tmp_path / "bad.log", "--kv-events-config", '{"enable_kv_cache_events": 1, "x": 2}')
    try:
        assert srv.proc.wait(60) == 2
        assert "--kv-events-config" in srv.log()
    finally:
        srv.stop()


def _receive_one(sub: zmq.Socket, pub, timeout_s: float = 10.0) -> list[bytes] | None:
    """Publishes until `sub` receives a batch (PUB/SUB drops whatever precedes the subscription)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
        if sub.poll(100):
            return sub.recv_multipart()
    return None


def test_publisher_binds_an_address_of_this_machine_and_connects_to_a_bound_collector():
    from server_utils import free_port

    from pdserve.kv_events.publisher import ZmqEventPublisher

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    try:  # vLLM's documented single-host form: a plain subscriber connects to it
        assert pub.mode == "bind" and pub.endpoint == endpoint
        sub.connect(endpoint)
        frames = _receive_one(sub, pub)
        assert frames is not None and frames[0] == b"" and decode_batch(frames[2]).events == [AllBlocksCleared()]
    finally:
        pub.shutdown()
        sub.close(linger=0)
    collector = ctx.socket(zmq.SUB)  # llm-d's convention: the collector binds, publishers connect to it
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    port = free_port()
    collector.bind(f"tcp://127.0.0.1:{port}")
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}"))
    try:
        assert pub.mode == "connect"
        assert _receive_one(collector, pub) is not None
    finally:
        pub.shutdown()
        collector.close(linger=0)
        ctx.term()
