"""Routing by cached prefix, the pure parts: the fleet-wide index, one instance's event feed (sequence
numbers, replay, resync), the cost and outcome of a choice, and a subscriber against a real ZMQ publisher."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.kv_events.block_hash import external_block_hashes
from pdserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from pdserve.proxy.kv_feed import InstanceFeed
from pdserve.proxy.kv_fleet import endpoints_from_info
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.kv_routing import HIT, MISS, UNCACHED, CachedPrefix, cacheable_hashes, lookup
from pdserve.proxy.pool import Pool

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"
BS = 4


def stored(hashes: list[int], medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[0] * (BS * len(hashes)),
                       block_size=BS, medium=medium)


def payload(*events: object) -> bytes:
    return encode_batch(KVEventBatch(ts=time.time(), events=list(events)))  # type: ignore[arg-type]


# ---- the index ----------------------------------------------------------------------------------------
def test_index_store_remove_clear_and_media() -> None:
    idx = KVIndex()
    idx.store(A, [1, 2, 3])
    idx.store(B, [1, 2])
    idx.store(A, [3], "CPU")
    assert idx.prefix_blocks([1, 2, 3, 4]) == {A: 3, B: 2}
    assert idx.media(A, 3) == {"GPU", "CPU"}
    idx.remove(A, [3], "GPU")  # still on the host tier: still cached
    assert idx.prefix_blocks([1, 2, 3]) == {A: 3, B: 2}
    idx.remove(A, [3], "CPU")
    assert idx.prefix_blocks([1, 2, 3]) == {A: 2, B: 2}
    idx.remove(A, [99])  # unknown hash: ignored
    assert len(idx) == 2 and idx.entries == 4
    assert idx.clear(A) == 2
    assert idx.prefix_blocks([1, 2, 3]) == {B: 2}
    assert idx.instances() == [B]
    assert idx.clear(A) == 0


def test_index_prefix_stops_at_the_first_missing_block_and_filters_instances() -> None:
    idx = KVIndex()
    idx.store(A, [1, 3])  # 2 missing: only the first block counts
    idx.store(B, [1, 2, 3])
    assert idx.prefix_blocks([1, 2, 3]) == {A: 1, B: 3}
    assert idx.prefix_blocks([1, 2, 3], urls=[A]) == {A: 1}
    assert idx.prefix_blocks([2, 3]) == {B: 2}
    assert idx.prefix_blocks([]) == {}
    assert idx.prefix_blocks([7]) == {}


def test_index_applies_decoded_batches_in_order() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    assert feed.receive(0, payload(stored([1, 2, 3]), BlockRemoved([3], "GPU"))) is None
    assert idx.prefix_blocks([1, 2, 3]) == {A: 2}
    assert feed.receive(1, payload(AllBlocksCleared(), stored([5]))) is None
    assert idx.prefix_blocks([1]) == {} and idx.prefix_blocks([5]) == {A: 1}
    assert (feed.batches, feed.events) == (2, 4)


# ---- sequence numbers ---------------------------------------------------------------------------------
def test_feed_gap_is_replayed() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    p0, p1, p2 = payload(stored([1])), payload(stored([2])), payload(stored([3]))
    assert feed.receive(0, p0) is None
    assert feed.receive(2, p2) == 1  # batch 1 was lost
    feed.replayed(1, [(1, p1), (2, p2)])
    assert feed.next_seq == 3 and idx.instance_blocks(A) == 3
    assert feed.receive(2, p2) is None and feed.duplicates == 1  # already applied by the replay
    assert feed.resyncs["clear"] == 0


def test_feed_replay_that_lost_the_gap_clears_the_instance() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    feed.receive(0, payload(stored([1])))
    assert feed.receive(5, payload(stored([6]))) == 1
    feed.replayed(1, [(4, payload(stored([4]))), (5, payload(stored([5])))])  # the buffer starts at 4
    assert feed.resyncs["clear"] == 1
    assert idx.prefix_blocks([1]) == {}  # what was known before the gap is not trusted
    assert idx.prefix_blocks([4]) == {A: 1} and idx.prefix_blocks([5]) == {A: 1}
    assert feed.next_seq == 6


def test_feed_without_replay_clears_and_follows() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    feed.receive(0, payload(stored([1])))
    p3 = payload(stored([3]))
    assert feed.receive(3, p3) == 1
    feed.replay_failed(3, p3, "no replay endpoint")
    assert idx.prefix_blocks([1]) == {} and idx.prefix_blocks([3]) == {A: 1}
    assert feed.next_seq == 4 and feed.resyncs["clear"] == 1


def test_feed_joining_late_replays_from_zero_and_reset_forgets() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    p0, p1 = payload(stored([1])), payload(stored([2]))
    assert feed.receive(1, p1) == 0
    feed.replayed(0, [(0, p0), (1, p1)])
    assert idx.instance_blocks(A) == 2 and feed.resyncs["clear"] == 0
    feed.reset()  # the publisher went away
    assert idx.instance_blocks(A) == 0 and feed.next_seq is None and feed.resyncs["reset"] == 1
    # a restarted publisher numbers from 0 again
    assert feed.receive(0, payload(stored([9]))) is None
    assert idx.prefix_blocks([9]) == {A: 1}


def test_feed_empty_replay_on_connect_expects_batch_zero() -> None:
    feed = InstanceFeed(A, KVIndex())
    feed.replayed(0, [])
    assert feed.next_seq == 0


def test_feed_skips_undecodable_batches() -> None:
    idx = KVIndex()
    feed = InstanceFeed(A, idx)
    assert feed.receive(0, b"\xc1not msgpack") is None
    assert feed.decode_errors == 1 and feed.next_seq == 1
    feed.receive(1, payload(stored([1])))
    assert idx.prefix_blocks([1]) == {A: 1}


# ---- hashes, cost, outcome ----------------------------------------------------------------------------
def test_cacheable_hashes_leave_the_last_token_to_compute() -> None:
    ids = list(range(100, 112))  # exactly 3 blocks of 4
    assert cacheable_hashes(ids, BS) == external_block_hashes(ids[:8], BS)  # the engine computes >= 1 token
    assert cacheable_hashes(ids + [7], BS) == external_block_hashes(ids, BS)
    assert cacheable_hashes([], BS) == []


def test_lookup_and_cost_prefer_the_holder_unless_it_is_busier_than_the_work_saved() -> None:
    ids = list(range(1, 42))  # 41 tokens: 10 cacheable blocks of 4
    idx = KVIndex()
    idx.store(B, cacheable_hashes(ids, BS))
    pool = Pool("prefill", [A, B], healthy=True)
    a, b = pool.instances
    prefix = lookup(idx, ids, {A: BS, B: BS}, weight=1.0)
    assert prefix.cached == {B: 40} and prefix.uncached_tokens(b) == 1 and prefix.uncached_tokens(a) == 41
    for _ in range(4):  # ties or not, B every time
        assert pool.choose(cost=prefix.cost) is b
    b.acquire(39)  # B has 39 tokens queued: 1 + 39 < 41 + 0
    assert pool.choose(cost=prefix.cost) is b
    b.acquire(2)  # 1 + 41 > 41: A computes the whole prompt sooner
    assert pool.choose(cost=prefix.cost) is a
    assert prefix.outcome(a, pool.instances, 0.9) == MISS
    assert prefix.outcome(b, pool.instances, 0.9) == HIT
    assert CachedPrefix(41).outcome(a, pool.instances, 0.9) == UNCACHED
    weightless = lookup(idx, ids, {A: BS, B: BS}, weight=0.0)  # load only
    assert pool.choose(cost=weightless.cost) is a


def test_lookup_with_different_block_sizes() -> None:
    ids = list(range(1, 18))
    idx = KVIndex()
    idx.store(A, cacheable_hashes(ids, 4))
    idx.store(B, cacheable_hashes(ids, 8)[:1])
    prefix = lookup(idx, ids, {A: 4, B: 8}, weight=1.0)
    assert prefix.cached == {A: 16, B: 8}


def test_cost_ties_rotate() -> None:
    pool = Pool("decode", [A, B], healthy=True)
    prefix = CachedPrefix(10)
    chosen = {pool.choose(cost=prefix.cost).url for _ in range(4)}
    assert chosen == {A, B}


def test_endpoints_from_info() -> None:
    info = {"block_size": 16, "kv_events": {"endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://10.0.0.1:5558",
                                            "topic": "kv", "block_size": 16, "block_hash": "sha256_cbor_64bit"}}
    ep = endpoints_from_info(info)
    assert ep is not None and (ep.endpoint, ep.replay_endpoint, ep.topic, ep.block_size) == (
        "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv", 16)
    assert endpoints_from_info({"kv_events": None}) is None
    assert endpoints_from_info({}) is None
    assert endpoints_from_info({"kv_events": {**info["kv_events"], "block_hash": "xxhash"}}) is None
    assert endpoints_from_info({"kv_events": {**info["kv_events"], "block_size": 0}}) is None


# ---- a subscriber against the real publisher ----------------------------------------------------------
async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("with_replay", [True, False])
def test_subscriber_follows_a_real_publisher(with_replay: bool) -> None:
    zmq = pytest.importorskip("zmq")
    del zmq
    from pdserve.kv_events.publisher import ZmqEventPublisher
    from pdserve.proxy.kv_subscriber import EventEndpoints, EventSubscriber
    from pdserve.types.kv_events_config import KVEventsConfig

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                         replay_endpoint="tcp://127.0.0.1:*" if with_replay else None, topic="kv")
    pub = ZmqEventPublisher(cfg)
    disconnects: list[int] = []

    async def main() -> None:
        idx = KVIndex()
        feed = InstanceFeed(A, idx)
        # published before anyone subscribed: only a replay can tell
        pub.publish(KVEventBatch(ts=time.time(), events=[stored([1, 2])]))
        await _until(lambda: pub.num_published == 1)
        # (a bound publisher has a replay socket even unasked: the subscriber without one is told none)
        sub = EventSubscriber(A, EventEndpoints(pub.endpoint, pub.replay_endpoint if with_replay else None, "kv", BS),
                              feed,
                              on_disconnect=lambda: disconnects.append(1))
        sub.start()
        try:
            await _until(lambda: sub.connected)
            if with_replay:
                await _until(lambda: idx.prefix_blocks([1, 2]) == {A: 2})
            # live events; the SUB subscription may take a moment to reach the publisher
            n = 0
            while idx.prefix_blocks([10]) != {A: 1}:
                n += 1
                pub.publish(KVEventBatch(ts=time.time(), events=[stored([10])]))
                await asyncio.sleep(0.05)
                assert n < 200
            pub.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([10], "GPU"), stored([11])]))
            await _until(lambda: idx.prefix_blocks([11]) == {A: 1} and idx.prefix_blocks([10]) == {})
            # without a replay socket the batch published before subscribing is lost, and a late join is
            # followed from where it is (nothing cleared: nothing was known)
            assert (idx.prefix_blocks([1, 2]) == {A: 2}) is with_replay
            pub.shutdown()  # the publisher goes away: its entries go at once
            await _until(lambda: idx.instance_blocks(A) == 0 and not sub.connected)
            assert disconnects and feed.resyncs["reset"] == 1
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        pub.shutdown()



# ---- the fleet: subscriptions follow the pools -------------------------------------------------------
def test_fleet_follows_pools_ejections_and_unreachable_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real HTTP servers answer /pdserve/info for three instances: one publishing (a real publisher), one
    publishing nothing, one advertising an endpoint nobody listens on."""
    pytest.importorskip("zmq")
    import aiohttp
    from aiohttp import web
    from server_utils import free_port

    from pdserve.kv_events.publisher import ZmqEventPublisher
    from pdserve.proxy import kv_fleet
    from pdserve.proxy.kv_fleet import KVFleet
    from pdserve.types.kv_events_config import KVEventsConfig

    monkeypatch.setattr(kv_fleet, "REDISCOVER_AFTER_S", 0.5)
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                                           replay_endpoint="tcp://127.0.0.1:*"))
    events = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": "", "block_size": BS,
              "block_hash": "sha256_cbor_64bit"}
    infos = {"good": {"kv_events": events}, "silent": {"kv_events": None},
             "dead": {"kv_events": {**events, "endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": None}}}
    asked: list[str] = []

    async def main() -> None:
        runners = []
        urls: dict[str, str] = {}
        for name, info in infos.items():
            async def handler(request: web.Request, name: str = name, info: dict = info) -> web.Response:
                asked.append(name)
                return web.json_response(info)

            app = web.Application()
            app.router.add_get("/pdserve/info", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        pool = Pool("decode", urls.values(), healthy=True)
        by_name = {name: pool.get(url) for name, url in urls.items()}
        session = aiohttp.ClientSession()
        fleet = KVFleet(lambda: [pool], lambda: session, info_timeout=2.0)
        try:
            await fleet.sync()
            assert fleet.publishing(urls["good"]) and fleet.publishing(urls["dead"])
            assert not fleet.publishing(urls["silent"]) and fleet.block_size(urls["good"]) == BS
            n = 0
            while fleet.index.prefix_blocks([1]) != {urls["good"]: 1}:
                pub.publish(KVEventBatch(ts=time.time(), events=[stored([1])]))
                await asyncio.sleep(0.05)
                n += 1
                assert n < 200
            await fleet.sync()  # the silent one is not asked again while it stays admitted
            assert asked.count("silent") == 1
            # the dead endpoint: dropped after REDISCOVER_AFTER_S, then asked again
            await asyncio.sleep(0.6)
            await fleet.sync()
            await fleet.sync()
            assert asked.count("dead") >= 2 and fleet.publishing(urls["dead"])
            # ejection: unsubscribed, entries gone; admitted again: asked again
            by_name["good"].record_failure("test", 1)
            await fleet.sync()
            assert not fleet.publishing(urls["good"]) and fleet.index.instance_blocks(urls["good"]) == 0
            by_name["good"].record_success()
            by_name["silent"].record_failure("test", 1)
            by_name["silent"].record_success()
            await fleet.sync()
            assert fleet.publishing(urls["good"]) and asked.count("good") == 2 and asked.count("silent") == 2
            # leaving the pool
            pool.remove(urls["good"])
            await fleet.sync()
            assert not fleet.publishing(urls["good"])
            assert fleet.stats()["events"] >= 1
        finally:
            await fleet.stop()
            await session.close()
            for runner in runners:
                await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        pub.shutdown()
