"""What the proxy knows of the fleet's KV caches: the index, and one event subscriber per publishing instance.

The subscribers follow the pools (fixed lists, the admin route, Ray discovery alike): every `SYNC_INTERVAL_S`
(and at once when nudged) each admitted instance not yet known is asked for its `GET /pdserve/info`; one
whose `kv_events` names an endpoint (and the block hash scheme the proxy computes,
`pdserve.kv_events.block_hash`) gets a subscriber. An instance that leaves its pool or is ejected by the
health checker loses its subscriber and its index entries; when it is admitted again it is asked again
(it may have restarted with other settings). A dead instance's entries go sooner: its ZMQ connection
drops (see kv_subscriber.py). A subscription whose endpoint stays unreachable for `REDISCOVER_AFTER_S`
while the instance answers HTTP is dropped and the instance asked again (a restart faster than the
health checker's ejection, with a random events port, leaves the old endpoint dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.proxy.background import BackgroundTask
from pdserve.proxy.kv_feed import RESYNC_KINDS, InstanceFeed
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.kv_subscriber import EventEndpoints, EventSubscriber
from pdserve.proxy.pool import Instance, Pool

logger = logging.getLogger("pdserve.proxy")

SYNC_INTERVAL_S = 0.5
REDISCOVER_AFTER_S = 10.0
# The block identities the proxy computes from token ids (pdserve.kv_events.block_hash); an instance that
# advertises another scheme publishes hashes the proxy cannot match, so it is not subscribed to.
KNOWN_HASH_SCHEMES = ("sha256_cbor_64bit",)


def endpoints_from_info(info: Any) -> EventEndpoints | None:
    """The `kv_events` of an instance's /pdserve/info, or None when it publishes none the proxy can use."""
    if not isinstance(info, dict):
        return None
    ev = info.get("kv_events")
    if not isinstance(ev, dict):
        return None
    endpoint, replay, topic = ev.get("endpoint"), ev.get("replay_endpoint"), ev.get("topic", "")
    snapshot = ev.get("snapshot_endpoint")
    block_size = ev.get("block_size", info.get("block_size"))
    scheme = ev.get("block_hash")
    if not isinstance(endpoint, str) or not endpoint or type(block_size) is not int or block_size < 1:
        return None
    if ev.get("endpoint_mode", "bind") != "bind":
        logger.warning("kv events: the instance connects out to %s (a collector binds there), the proxy cannot "
                       "subscribe; give it an endpoint of its own machine (tcp://HOST:PORT) or a wildcard", endpoint)
        return None
    if scheme not in KNOWN_HASH_SCHEMES:
        logger.warning("kv events: block hash scheme %r is not one the proxy computes %s", scheme, KNOWN_HASH_SCHEMES)
        return None
    return EventEndpoints(endpoint, replay if isinstance(replay, str) and replay else None,
                          topic if isinstance(topic, str) else "", block_size,
                          snapshot if isinstance(snapshot, str) and snapshot else None)


@dataclass
class _Publisher:
    endpoints: EventEndpoints
    feed: InstanceFeed
    subscriber: EventSubscriber
    ejections: int  # the instance's ejection count when subscribed: a later ejection means it may have changed
    pins: bool = False  # its /pdserve/info has kv_peer_pin: it pins a cached prefix for a peer on demand


class KVFleet:
    def __init__(
        self,
        pools: Callable[[], list[Pool]],
        session: Callable[[], aiohttp.ClientSession],
        *,
        info_timeout: float,
        replay_timeout: float = 2.0,
        on_disconnect: Callable[[], None] = lambda: None,
    ) -> None:
        self.index = KVIndex()
        self._pools = pools
        self._session = session
        self._info_timeout = aiohttp.ClientTimeout(total=info_timeout)
        self._replay_timeout = replay_timeout
        self._on_disconnect = on_disconnect
        self._publishers: dict[str, _Publisher] = {}
        self._silent: dict[str, int] = {}  # instances found without events -> their ejection count then
        self._background = BackgroundTask(self._run, "pdserve-proxy-kv-fleet")
        self._wake = asyncio.Event()
        # totals of feeds that are gone (instances that left), so that the counters never go back
        self._retired: Counter[str] = Counter()

    # ---- what the router asks ----------------------------------------------------------------------
    def publishing(self, url: str) -> bool:
        return url in self._publishers

    def pins(self, url: str) -> bool:
        """The instance pins cached prefixes for peers (POST /pdserve/kv/pin) and can read them (both need
        bidirectional_kv_xfer, so a pinning instance is also a reader)."""
        pub = self._publishers.get(url)
        return pub is not None and pub.pins

    def block_size(self, url: str) -> int | None:
        pub = self._publishers.get(url)
        return pub.endpoints.block_size if pub is not None else None

    def any_publishing(self, instances: list[Instance]) -> bool:
        return any(inst.url in self._publishers for inst in instances)

    def connected(self, url: str) -> bool:
        pub = self._publishers.get(url)
        return pub is not None and pub.subscriber.connected

    def stats(self) -> dict[str, int]:
        """Totals over all feeds, past and present (for /metrics)."""
        total = Counter(self._retired)
        for pub in self._publishers.values():
            total.update(_feed_counts(pub.feed))
        return dict(total)

    def publishers(self) -> int:
        return len(self._publishers)

    # ---- following the pools -----------------------------------------------------------------------
    def nudge(self) -> None:
        self._wake.set()

    async def sync(self) -> None:
        instances = {inst.url: inst for pool in self._pools() for inst in pool.instances}
        for url in list(self._publishers):
            inst = instances.get(url)
            pub = self._publishers[url]
            if inst is None or not inst.healthy or inst.ejections_total != pub.ejections:
                await self._drop(url, "left its pool" if inst is None else "was ejected")
            elif pub.subscriber.unreachable_for() > REDISCOVER_AFTER_S:
                await self._drop(url, f"events endpoint {pub.endpoints.endpoint} unreachable for "
                                      f"{REDISCOVER_AFTER_S:g}s; asking its /pdserve/info again")
        for url in list(self._silent):
            inst = instances.get(url)
            if inst is None or inst.ejections_total != self._silent[url]:
                del self._silent[url]  # ask again when it is back
        todo = [inst for url, inst in instances.items()
                if inst.healthy and url not in self._publishers and url not in self._silent]
        if todo:
            await asyncio.gather(*(self._discover(inst) for inst in todo))

    async def _discover(self, inst: Instance) -> None:
        try:
            async with self._session().get(inst.endpoint("/pdserve/info"), timeout=self._info_timeout) as resp:
                info = await resp.json() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            logger.debug("kv events: /pdserve/info of %s: %s", inst.url, exc)
            return  # asked again on the next sync
        if inst.url in self._publishers or not inst.healthy:
            return
        endpoints = endpoints_from_info(info)
        if endpoints is None:
            self._silent[inst.url] = inst.ejections_total
            logger.info("kv events: %s publishes none; it is routed by load (and --prefix-affinity) only", inst.url)
            return
        feed = InstanceFeed(inst.url, self.index)
        sub = EventSubscriber(inst.url, endpoints, feed, replay_timeout=self._replay_timeout,
                              on_disconnect=self._on_disconnect)
        pins = isinstance(info, dict) and isinstance(info.get("kv_peer_pin"), dict)
        self._publishers[inst.url] = _Publisher(endpoints, feed, sub, inst.ejections_total, pins)
        sub.start()
        logger.info("kv events: subscribing to %s at %s (replay %s, snapshots %s, block size %d)", inst.url,
                    endpoints.endpoint, endpoints.replay_endpoint or "-", endpoints.snapshot_endpoint or "-",
                    endpoints.block_size)

    async def _drop(self, url: str, why: str) -> None:
        pub = self._publishers.pop(url)
        await pub.subscriber.stop()
        self._retired.update(_feed_counts(pub.feed))
        dropped = self.index.clear(url)
        logger.info("kv events: %s %s; unsubscribed, %d blocks dropped from the index", url, why, dropped)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.sync()
            except Exception:  # a bug here must not stop the proxy: routing falls back to load only
                logger.exception("kv events: sync with the pools failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), SYNC_INTERVAL_S)

    def start(self) -> None:
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()
        for url in list(self._publishers):
            await self._drop(url, "proxy stopping")


def _feed_counts(feed: InstanceFeed) -> Counter[str]:
    counts: Counter[str] = Counter(batches=feed.batches, events=feed.events, decode_errors=feed.decode_errors,
                                   duplicates=feed.duplicates, dropped=feed.dropped, snapshots=feed.snapshots)
    for kind in RESYNC_KINDS:
        counts[f"resync_{kind}"] = feed.resyncs[kind]
    return counts
