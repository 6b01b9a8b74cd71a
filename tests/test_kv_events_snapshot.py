"""KV events a fleet can trust, the parts below a whole server: the snapshot recorder, the publisher's snapshot
service, identity frames and heartbeats on real ZMQ sockets (vLLM's `docs/features/kv_events.md`), the feed's
bootstrap and resync procedure, a subscriber against a real publisher with messages dropped, and block hashes
that do not depend on PYTHONHASHSEED (two processes)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from pdserve.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from pdserve.kv_events.snapshot import SnapshotRecorder
from pdserve.proxy.kv_feed import InstanceFeed
from pdserve.proxy.kv_index import KVIndex

A = "http://127.0.0.1:1"
BS = 4
PID1, PID2 = b"\x01" * 16, b"\x02" * 16


def stored(hashes: list[int], parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(list(hashes), parent, list(range(BS * len(hashes))), BS, medium=medium)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))  # type: ignore[arg-type]


def payload(*events: object) -> bytes:
    return encode_batch(batch(*events))


def snapshot_reply(seq: int, pid: bytes, recorder: SnapshotRecorder | None = None) -> list[bytes]:
    chunks = [encode_batch(b) for b in recorder.chunks()] if recorder is not None else []
    return [seq.to_bytes(8, "big", signed=True), pid, *chunks]


def held(rec: SnapshotRecorder) -> dict[str, list[int]]:
    idx = KVIndex()
    for b in rec.chunks():
        idx.apply(A, b)
    return {m: sorted(h for h in (1, 2, 3, 4, 5, 6, 7, 8) if m in idx.media(A, h)) for m in ("GPU", "CPU")}


# ---- the recorder --------------------------------------------------------------------------------------
def test_recorder_follows_stores_removals_and_the_device_reset() -> None:
    rec = SnapshotRecorder()
    rec.apply(batch(stored([1, 2, 3]), stored([4], parent=3), stored([2], parent=1, medium="CPU")))
    rec.apply(batch(BlockRemoved([3], "GPU"), BlockRemoved([9], "GPU")))  # 9 never stored: ignored
    assert held(rec) == {"GPU": [1, 2, 4], "CPU": [2]}
    # chained blocks go out as one event, in store order, with their tokens
    events = [e for b in rec.chunks() for e in b.events]
    assert [(e.block_hashes, e.parent_block_hash, e.medium) for e in events] == [
        ([1, 2], None, "GPU"), ([4], 3, "GPU"), ([2], 1, "CPU")]
    assert events[0].token_ids == list(range(2 * BS))
    rec.apply(batch(AllBlocksCleared()))  # the device pool's reset: host-tier blocks stay
    assert held(rec) == {"GPU": [], "CPU": [2]} and rec.blocks == 1
    # a second reference of one hash is kept (one removal leaves it held)
    rec.apply(batch(stored([5]), stored([5])))
    rec.apply(batch(BlockRemoved([5], "GPU")))
    assert held(rec)["GPU"] == [5]
    assert len(rec.chunks(chunk_blocks=1)) == 2  # one block per chunk


def test_recorder_is_invalid_past_its_limit() -> None:
    rec = SnapshotRecorder(max_blocks=2)
    rec.apply(batch(stored([1, 2, 3])))
    assert rec.invalid is not None and rec.blocks == 0
    rec.apply(batch(stored([4])))  # stays invalid until the publisher restarts
    assert rec.invalid is not None and rec.blocks == 0


# ---- the feed's bootstrap -------------------------------------------------------------------------------
def test_feed_installs_a_snapshot_then_the_buffered_suffix_and_follows() -> None:
    idx = KVIndex()
    idx.store(A, [99])  # what an older life said: replaced by the snapshot
    feed = InstanceFeed(A, idx)
    rec = SnapshotRecorder()
    rec.apply(batch(stored([1, 2])))
    assert feed.live(PID1, 5, payload(stored([7])))  # at or below the snapshot's seq: already in it
    assert feed.live(PID1, 6, payload(stored([3], parent=2)))  # buffered while the snapshot is on its way
    assert feed.install(snapshot_reply(5, PID1, rec)) is None
    assert feed.ready and feed.next_seq == 7 and feed.snapshots == 1
    assert idx.prefix_blocks([1, 2, 3]) == {A: 3} and idx.prefix_blocks([99]) == {} and idx.prefix_blocks([7]) == {}
    assert not feed.live(PID1, 7, payload(BlockRemoved([3], "GPU")))
    assert not feed.live(PID1, 7, payload(stored([8])))  # a duplicate: skipped
    assert idx.prefix_blocks([1, 2, 3]) == {A: 2} and feed.duplicates == 1


def test_feed_gap_keeps_entries_until_a_new_snapshot_replaces_them() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    rec = SnapshotRecorder()
    rec.apply(batch(stored([1])))
    feed.live(PID1, 0, payload(stored([1])))
    assert feed.install(snapshot_reply(0, PID1, rec)) is None
    # batch 1 lost: the feed asks for a snapshot, the old entries stay meanwhile
    assert feed.live(PID1, 2, payload(stored([3])))
    assert not feed.ready and idx.prefix_blocks([1]) == {A: 1}
    rec.apply(batch(stored([2], parent=1)))
    rec.apply(batch(stored([3])))
    assert feed.install(snapshot_reply(2, PID1, rec)) is None
    assert idx.prefix_blocks([1, 2]) == {A: 2} and idx.prefix_blocks([3]) == {A: 1}
    assert feed.resyncs["snapshot"] == 1 and feed.next_seq == 3


def test_feed_new_identity_clears_at_once_and_failed_snapshots_are_retried() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    rec = SnapshotRecorder()
    rec.apply(batch(stored([1])))
    feed.live(PID1, 0, payload())
    assert feed.install(snapshot_reply(0, PID1, rec)) is None
    assert feed.live(PID2, 0, payload())  # the publisher restarted: nothing of its previous life is trusted
    assert idx.instance_blocks(A) == 0 and feed.resyncs["clear"] == 1
    # a reply from the old life, a malformed one, a gap while buffering: not installed
    assert feed.install(snapshot_reply(0, PID1, rec)) is not None
    assert feed.install([b"\x00"]) is not None
    feed.live(PID2, 3, payload())
    feed.live(PID2, 5, payload())
    assert "gap" in (feed.install(snapshot_reply(2, PID2)) or "")
    assert not feed.ready
    # snapshot unavailable (-2): the instance is cleared and the stream followed from the newest message
    feed.live(PID2, 6, payload(stored([4])))
    assert feed.install(snapshot_reply(-2, PID2)) == "snapshot unavailable"
    assert feed.ready and idx.prefix_blocks([4]) == {A: 1} and feed.next_seq == 7


# ---- the publisher on real sockets ---------------------------------------------------------------------
def _publisher(**extra: object):
    pytest.importorskip("zmq")
    from pdserve.kv_events.publisher import ZmqEventPublisher
    from pdserve.types.kv_events_config import KVEventsConfig

    return ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic="kv",
                                            snapshot_endpoint="tcp://127.0.0.1:*", **extra))  # type: ignore[arg-type]


def test_publisher_identity_frames_heartbeats_replay_and_snapshots() -> None:
    import zmq

    pub = _publisher(replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context.instance()
    socks = []
    try:
        req = ctx.socket(zmq.REQ)
        socks.append(req)
        req.connect(pub.snapshot_endpoint)
        req.send(b"snapshot")
        assert req.poll(5000)
        seq, pid, *chunks = req.recv_multipart()
        assert int.from_bytes(seq, "big", signed=True) == -1 and pid == pub.publisher_id and chunks == []
        sub = ctx.socket(zmq.SUB)
        socks.append(sub)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        # idle: an empty batch every second, numbered, with the identity after the 8-byte seq
        assert sub.poll(5000)
        topic, frame, body = sub.recv_multipart()
        assert topic == b"kv" and len(frame) == 24 and frame[8:] == pub.publisher_id
        assert decode_batch(body).events == []
        pub.publish(batch(stored([1, 2]), stored([3], medium="CPU")))
        pub.publish(batch(BlockRemoved([2], "GPU")))
        seqs = []
        while len(seqs) < 2 or decode_batch(body).events == []:
            assert sub.poll(5000)
            _, frame, body = sub.recv_multipart()
            seqs.append(int.from_bytes(frame[:8], "big"))
        last = seqs[-1]
        # a DEALER's request is one frame; the reply has no delimiter
        dealer = ctx.socket(zmq.DEALER)
        socks.append(dealer)
        dealer.connect(pub.snapshot_endpoint)
        dealer.send(b"snapshot")
        assert dealer.poll(5000)
        seq, pid, *chunks = dealer.recv_multipart()
        assert int.from_bytes(seq, "big", signed=True) >= last and pid == pub.publisher_id
        events = [e for c in chunks for e in decode_batch(c).events]
        assert [(e.block_hashes, e.medium) for e in events] == [([1], "GPU"), ([3], "CPU")]
        # replay data carries the 24-byte frame too; the end marker stays 8 bytes
        replay = ctx.socket(zmq.DEALER)
        socks.append(replay)
        replay.connect(pub.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            assert replay.poll(5000)
            _, frame, body = replay.recv_multipart()
            if len(frame) == 8:
                assert int.from_bytes(frame, "big", signed=True) == -1
                break
            assert len(frame) == 24 and frame[8:] == pub.publisher_id
            frames.append(int.from_bytes(frame[:8], "big"))
        assert frames == list(range(len(frames))) and frames[-1] >= last
        # a malformed request, then a recorder that lost input: -2, no chunks
        dealer.send(b"everything")
        assert dealer.poll(5000) and int.from_bytes(dealer.recv_multipart()[0], "big", signed=True) == -2
        pub.recorder.invalidate("test")
        dealer.send(b"snapshot")
        assert dealer.poll(5000)
        seq, pid, *chunks = dealer.recv_multipart()
        assert int.from_bytes(seq, "big", signed=True) == -2 and chunks == []
    finally:
        for s in socks:
            s.close(linger=0)
        pub.shutdown()


def test_publisher_without_snapshots_keeps_vllms_plain_frames() -> None:
    pytest.importorskip("zmq")
    from pdserve.kv_events.publisher import ZmqEventPublisher
    from pdserve.types.kv_events_config import KVEventsConfig

    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"))
    try:
        assert pub.publisher_id is None and pub.snapshot_endpoint is None and pub._seq_frame(3) == (3).to_bytes(8, "big")
    finally:
        pub.shutdown()


async def _until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def test_subscriber_bootstraps_from_a_snapshot_and_resyncs_after_dropped_messages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks published before the subscriber existed come from the snapshot (no replay socket at all); with
    40% of live messages dropped on arrival every gap is seen and the index ends equal to the publisher's."""
    pytest.importorskip("zmq")
    from pdserve.proxy.kv_subscriber import EventEndpoints, EventSubscriber

    pub = _publisher()

    async def main() -> None:
        pub.publish(batch(stored([1, 2])))
        await _until(lambda: pub.num_published >= 1)
        idx = KVIndex()
        feed = InstanceFeed(A, idx)
        monkeypatch.setenv("PDSERVE_CHAOS_KV_EVENTS_DROP", "0")
        sub = EventSubscriber(A, EventEndpoints(pub.endpoint, None, "kv", BS, pub.snapshot_endpoint), feed)
        sub.start()
        try:
            await _until(lambda: feed.ready and idx.prefix_blocks([1, 2]) == {A: 2})
            pub.publish(batch(stored([3], parent=2)))
            await _until(lambda: idx.prefix_blocks([1, 2, 3]) == {A: 3})
            assert feed.snapshots == 1 and feed.resyncs["snapshot"] == 0
        finally:
            await sub.stop()
        # now a lossy subscriber
        monkeypatch.setenv("PDSERVE_CHAOS_KV_EVENTS_DROP", "0.4")
        idx2 = KVIndex()
        feed2 = InstanceFeed(A, idx2)
        sub2 = EventSubscriber(A, EventEndpoints(pub.endpoint, None, "kv", BS, pub.snapshot_endpoint), feed2)
        sub2.start()
        try:
            await _until(lambda: feed2.ready)
            for h in range(10, 40):
                pub.publish(batch(stored([h])))
                if h % 3 == 0:
                    pub.publish(batch(BlockRemoved([h - 1], "GPU")))
                await asyncio.sleep(0.01)
            truth = {h for h in range(1, 40) if idx_truth(pub, h)}
            # heartbeats keep coming: a lost last batch is a gap too; the index converges to the truth
            await _until(lambda: feed2.ready and {h for h in range(1, 40) if idx2.prefix_blocks([h])} == truth)
            assert feed2.dropped > 0 and feed2.resyncs["snapshot"] > 0
        finally:
            await sub2.stop()

    try:
        asyncio.run(main())
    finally:
        pub.shutdown()


def idx_truth(pub, h: int) -> bool:
    """Whether the publisher's own recorder holds block `h` (what the snapshot would say)."""
    return any(h in e.block_hashes for b in pub.recorder.chunks() for e in b.events)


# ---- block hashes across processes ---------------------------------------------------------------------
HASH_SCRIPT = """
import json, sys
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.kv_events.block_hash import external_block_hashes
from pdserve.types.sampling_params import SamplingParams
tokens = list(range(1000, 1000 + 67)) + [70000, 3, 150000]
req = Request("r", tokens, SamplingParams(max_tokens=1), frozenset(), 4096)
bm = BlockManager(num_blocks=16, block_size=16, enable_events=True)
assert bm.allocate(req, len(tokens))
req.num_computed_tokens = len(tokens)
bm.cache_full_blocks(req)
events = [(e.block_hashes, e.parent_block_hash) for e in bm.take_events()]
print(json.dumps({"router": external_block_hashes(tokens, 16), "events": events, "str_hash": hash("x")}))
"""


def test_block_hashes_do_not_depend_on_pythonhashseed() -> None:
    """Two processes with different PYTHONHASHSEED (their str hashes differ) compute the same block hashes, in
    the router's function and in the block manager's events; so does a third with the seed unset."""
    outs = []
    for seed in ("1", "2", None):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        run = subprocess.run([sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        outs.append(json.loads(run.stdout))
    assert outs[0]["str_hash"] != outs[1]["str_hash"]  # the seeds took effect
    assert outs[0]["router"] == outs[1]["router"] == outs[2]["router"] and len(outs[0]["router"]) == 4
    assert outs[0]["events"] == outs[1]["events"] == outs[2]["events"]
    assert [h for hashes, _ in outs[0]["events"] for h in hashes] == outs[0]["router"]
